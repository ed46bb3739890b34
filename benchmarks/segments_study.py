"""How the number of time segments of the GDN backward trades time against peak memory (CUDA).

For each forced segment count S (``override("gated_delta_rule", "backward_segments", value=S)``),
one forward+backward step of ``chunk_gated_delta_rule`` on the backward benchmark's inputs: median
ms (do_bench after warm-up) and the step's peak (peak allocated minus allocated before the step,
the way issue #4 measures FlashQLA). Rows go to $OUT/segments.jsonl as they are measured.

    python benchmarks/segments_study.py [--case 1,32768,32,32] [--segments 1,2,4,6,8]
"""
import argparse
import json
import os

import torch
import triton

from bench_backward import inputs
from generated.gated_delta_rule import chunk_gated_delta_rule
from gdngen.runtime.tiles import override

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="1,32768,32,32", help="B,T,H,HV (B must be 1 for segments)")
    parser.add_argument("--segments", default="4,6,8")
    a = parser.parse_args()
    B, T, H, HV = map(int, a.case.split(","))
    leaves, do = inputs(B, T, H, HV)

    def step():
        o, _ = chunk_gated_delta_rule(*leaves)
        o.backward(do)

    for segments in map(int, a.segments.split(",")):
        with override("gated_delta_rule", "backward_segments", value=segments):
            step()
            torch.cuda.synchronize()
            for x in leaves:
                x.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=leaves, return_mode="median")
        row = {"case": [B, T, H, HV], "segments": segments, "fwd_bwd_ms": ms, "peak_mib": peak}
        with open(os.path.join(OUT, "segments.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
