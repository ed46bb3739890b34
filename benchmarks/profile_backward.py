"""Where the GDN chunk forward+backward spends its time, and which backward tiles each stage prefers.

Per case: a per-kernel breakdown of one forward+backward step (torch.profiler, CUDA time per
step), then (--sweep) profile_stages' backward sweep (one backward stage's launch parameters at a
time, gdngen.runtime.backward_tiles.override_backward, the whole step timed with do_bench).
Breakdown rows go to $OUT/backward_stages.jsonl, sweep rows to $OUT/stages.jsonl, as measured.

    python benchmarks/profile_backward.py [--sweep] [--cases 0,1]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from gdngen.spec import load_spec
from generated.gated_delta_rule import chunk_gated_delta_rule

import profile_stages
from bench_backward import inputs

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
CASES = [(1, 32768, 32, 32), (4, 8192, 16, 32), (8, 2048, 16, 16)]


def log(row):
    with open(os.path.join(OUT, "backward_stages.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def step_of(leaves, do):
    def step():
        o, _ = chunk_gated_delta_rule(*leaves)
        o.backward(do)
    return step


def breakdown(case, leaves, do):
    step = step_of(leaves, do)
    step()
    torch.cuda.synchronize()
    reps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for x in leaves:
                x.grad = None
            step()
        torch.cuda.synchronize()
    total = 0.0
    for evt in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        us = evt.device_time_total / reps
        if us > 0:
            total += us
            log({"kind": "kernel", "case": case, "name": evt.key[:60], "us_per_step": us,
                 "calls_per_step": evt.count / reps})
    ms = triton.testing.do_bench(step, warmup=10, rep=100, grad_to_none=leaves, return_mode="median")
    log({"kind": "kernels_total", "case": case, "us_per_step": total, "do_bench_us": 1e3 * ms})


def sweep(case, leaves, do):
    """profile_stages' backward sweep (one stage's launch parameters at a time) on this GDN step."""
    step = step_of(leaves, do)

    def fresh_step():
        for x in leaves:
            x.grad = None
        step()
    profile_stages.sweep(load_spec("specs/gated_delta_rule.yaml"), case, fresh_step, backward=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--cases", default="0,1")
    a = parser.parse_args()
    for i in map(int, a.cases.split(",")):
        case = CASES[i]
        leaves, do = inputs(*case)
        breakdown(list(case), leaves, do)
        if a.sweep and i == 0:
            sweep(list(case), leaves, do)
        del leaves, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
