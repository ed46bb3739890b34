"""Where the GDN chunk forward spends its time, and which launch parameters each stage prefers.

Per case: a per-kernel breakdown (torch.profiler, CUDA time per call), then a sweep that varies one
stage's launch parameters at a time (gdngen.runtime.override) and times the whole forward with
do_bench. Rows go to $OUT/stages.jsonl as measured.

    python benchmarks/profile_stages.py [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton

from gdngen.runtime import override
from generated.gated_delta_rule import chunk_gated_delta_rule

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
CASES = [(4, 8192, 16, 32), (1, 131072, 16, 32), (8, 2048, 16, 16), (1, 32768, 2, 8)]
K = V = 128
SWEEP = {
    "wy": [dict(num_warps=w, num_stages=s) for w, s in itertools.product([2, 4, 8], [1, 2])],
    "state": [dict(BV=bv, num_warps=w, num_stages=s)
              for bv, w, s in itertools.product([16, 32, 64], [4, 8], [1, 2, 3])],
    "output": [dict(BK=bk, BV=bv, num_warps=w, num_stages=s)
               for bk, bv, w, s in itertools.product([64, 128], [64, 128], [4, 8], [2, 3])],
}


def log(row):
    with open(os.path.join(OUT, "stages.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def inputs(B, T, H, HV):
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 2)
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda"))
    return q, k, v, g, beta


def breakdown(case, args):
    fn = lambda: chunk_gated_delta_rule(*args)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    reps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.key_averages():
        us = evt.device_time_total / reps
        if us > 0:
            total += us
            log({"kind": "kernel", "case": case, "name": evt.key[:60], "us_per_call": us})
    log({"kind": "kernels_total", "case": case, "us_per_call": total,
         "do_bench_us": 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")})


def sweep(case, args):
    fn = lambda: chunk_gated_delta_rule(*args)  # noqa: E731
    for stage, variants in SWEEP.items():
        for cfg in variants:
            try:
                with override("gated_delta_rule", stage, **cfg):
                    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is data too
                log({"kind": "sweep", "case": case, "stage": stage, "cfg": cfg, "error": repr(exc)[:120]})
                continue
            log({"kind": "sweep", "case": case, "stage": stage, "cfg": cfg, "ms": ms})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--cases", default="0,1,2,3")
    a = parser.parse_args()
    for i in map(int, a.cases.split(",")):
        case = CASES[i]
        args = inputs(*case)
        breakdown(list(case), args)
        if a.sweep:
            sweep(list(case), args)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    with torch.no_grad():
        main()
