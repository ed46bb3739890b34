"""Forward time of the generated op against the state pass's piece count (CUDA only).

    python benchmarks/pieces_sweep.py [--spec gated_delta_rule] [--cases "1,32768,32,32 1,32768,2,8"] \
        [--pieces 1,2,3,5,8] [--out rows.jsonl]

Per case: the default's piece count, then for each count the forward's median ms (do_bench), the
state pass's kernels' device time (torch.profiler) and the output's relative RMSE against one piece.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from gdngen import bench  # noqa: E402
from gdngen.runtime import override  # noqa: E402
from gdngen.runtime.tiles import state_pieces, tiles  # noqa: E402
from gdngen.selfcheck import rel_rmse  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


def state_us(step) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if "_state_fwd" in e.key) / 5


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--cases", default="1,32768,32,32 1,32768,2,8")
    parser.add_argument("--pieces", default="1,2,3,5,8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    spec = load_spec(f"specs/{args.spec}.yaml")
    fn = getattr(importlib.import_module(f"generated.{args.spec}"), spec.chunk_function)
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        inputs = bench.make_inputs(spec, bench.Case(text, B, T, H, HV), torch.bfloat16, "cuda")
        def value_tile(n):
            return tiles(spec.name, "state", K=128, V=128, BT=64, N=n, HV=HV, dtype=torch.bfloat16, H=H, T=T)["BV"]
        default = state_pieces(spec.name, N=B, HV=HV, V=128, T=T, BT=64, value_tile=value_tile)
        with override(spec.name, "state_pieces", value=1):
            o_one = fn(**inputs)[0]
        for pieces in [int(p) for p in args.pieces.split(",")]:
            with override(spec.name, "state_pieces", value=pieces):
                def step():
                    with torch.no_grad():
                        return fn(**inputs)[0]
                o = step()
                ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                row = {"case": text, "pieces": pieces, "default": default, "ms": ms, "state_us": state_us(step),
                       "rel_vs_one_piece": rel_rmse(o, o_one)}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
