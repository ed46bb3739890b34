"""The fused backward's gradient errors against float64 beside the three Gluon kernels' and the Triton stages'.

Each row is ``gdngen.selfcheck.gradient_errors`` (relative RMSE of o and of every gradient, the initial state's
included) under one set of override switches, so a gap the GPU test's 5% bar reports can be placed: is it the
fused kernel's, or do the three kernels show it too (stop 66)?

    python benchmarks/fused_bwd_errors.py [--shape 1,8192,2,2] [--seed 39] [--out DIR]     # CUDA
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

NAME = "gated_delta_rule"
GLUON = dict(gluon_state_bwd=True, gluon_chunk_bwd=True, gluon_wy_bwd=True)
TRITON = dict(gluon_state_bwd=False, gluon_chunk_bwd=False, gluon_wy_bwd=False)
RUNS = {
    "fused, 4 pieces": dict(GLUON, gluon_fused_bwd=True, state_pieces=4),
    "three Gluon kernels, 4 pieces": dict(GLUON, gluon_fused_bwd=False, state_pieces=4),
    "Triton stages, 4 pieces": dict(TRITON, gluon_fused_bwd=False, state_pieces=4),
    "fused, 1 piece": dict(GLUON, gluon_fused_bwd=True, state_pieces=1),
    "Triton stages, 1 piece": dict(TRITON, gluon_fused_bwd=False, state_pieces=1),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,8192,2,2", help="B,T,H,HV (K = V = 128)")
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from gdngen.runtime import override
    from gdngen.selfcheck import gradient_errors
    B, T, H, HV = map(int, args.shape.split(","))
    out = open(Path(args.out) / "fused_bwd_errors.jsonl", "a")
    for label, switches in RUNS.items():
        with contextlib.ExitStack() as stack:
            for key, value in switches.items():
                stack.enter_context(override(NAME, key, value=value))
            errors = gradient_errors(NAME, {}, dtype=torch.bfloat16, device="cuda", seed=args.seed, K=128, V=128,
                                     B=B, T=T, H=H, HV=HV)
        row = dict(run=label, shape=[B, T, H, HV], seed=args.seed, **{k: float(f"{v:.5g}") for k, v in errors.items()})
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
