"""Where the GDN chunk forward+backward spends its time, and which backward tiles each stage prefers.

Per case: a per-kernel breakdown of one forward+backward step (torch.profiler, CUDA time per
step), then (--sweep) a sweep that varies one backward stage's launch parameters at a time
(gdngen.runtime.backward_tiles.override_backward) and times the whole step with do_bench.
Rows go to $OUT/backward_stages.jsonl as measured.

    python benchmarks/profile_backward.py [--sweep] [--cases 0,1]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton

from gdngen.runtime.backward_tiles import override_backward
from generated.gated_delta_rule import chunk_gated_delta_rule

from bench_backward import inputs

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
CASES = [(1, 32768, 32, 32), (4, 8192, 16, 32), (8, 2048, 16, 16)]
SWEEP = {
    "state": [dict(BV=bv, num_warps=w, num_stages=s)
              for bv, w, s in itertools.product([16, 32, 64], [4, 8], [2, 3])],   # s=1 crashed here
    "chunk": [dict(BK=bk, BV=bv, num_warps=w, num_stages=s)
              for bk, bv, w, s in itertools.product([64, 128], [64, 128], [4, 8], [2])],
    "wy": [dict(BK=64, BV=bv, num_warps=w, num_stages=2) for bv, w in itertools.product([64, 128], [4, 8])],
    "intra": [dict(BK=bk, BV=bv, num_warps=w) for bk, bv, w in itertools.product([64, 128], [64, 128], [4, 8])],
    "wy_prep": [dict(BK=bk, num_warps=w) for bk, w in itertools.product([64, 128], [4, 8])],
}


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
    step = step_of(leaves, do)
    for stage, variants in SWEEP.items():
        for cfg in variants:
            try:
                with override_backward(stage, **cfg):
                    ms = triton.testing.do_bench(step, warmup=5, rep=40, grad_to_none=leaves, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is data too
                log({"kind": "sweep", "case": case, "stage": stage, "cfg": cfg, "error": repr(exc)[:160]})
                continue
            log({"kind": "sweep", "case": case, "stage": stage, "cfg": cfg, "ms": ms})


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
