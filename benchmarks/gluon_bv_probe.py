"""The Gluon forward pass at half the values per program (two programs per SM) against all of them (one per
SM): stop 45 (CUDA sm_90 only).

    python benchmarks/gluon_bv_probe.py [--cases "4,8192,16,32 ..."] [--bvs "128 64"] [--training] [--profile]
                                        [--out rows.jsonl]

Per case: a check (NaN-poisoned buffers, the same pieces forced: o and the final state at every BV bit for bit
the first BV's), then the no-grad forward's ``do_bench`` median at each BV with the module's own piece count for
it, interleaved over two rounds (graph replay on, its cache cleared between BVs), and with ``--profile`` each
kernel's device time. ``--training`` times forward + backward instead (the training forward's pass at that BV).
The BV is switched by replacing the module's ``state_value_tile`` (an override would turn graph replay off).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

NAME = "gated_delta_rule"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="4,8192,16,32 1,32768,32,32 8,2048,16,16 1,131072,16,32 1,32768,2,8")
    parser.add_argument("--bvs", default="128 64", help="value tiles, the first the baseline")
    parser.add_argument("--training", action="store_true", help="time forward + backward instead")
    parser.add_argument("--profile", action="store_true", help="per-kernel device time too")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from benchmarks.fused_probe import inputs
    from benchmarks.gluon_state_probe import kernel_times
    from gdngen.runtime import override
    from gdngen.runtime.gluon import state_programs_per_sm
    from gdngen.runtime.graphs import GRAPHS
    from gdngen.runtime.tiles import state_pieces
    from gdngen.selfcheck import poisoned_memory
    module = importlib.import_module(f"generated.{NAME}")
    fn = module.chunk_gated_delta_rule
    bvs = [int(b) for b in args.bvs.split()]
    out = open(args.out, "a") if args.out else None

    def record(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    def use_bv(bv):
        module.state_value_tile = lambda spec_name, keep_states: bv
        GRAPHS.clear()

    def forward(x, **kw):
        with torch.no_grad():
            return fn(**x, **kw)

    def train_step(x):
        o, ht = fn(**x, output_final_state=True)
        torch.autograd.backward((o, ht), (torch.ones_like(o), torch.ones_like(ht)))

    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        x = inputs(B, T, H, HV)
        case = dict(B=B, T=T, H=H, HV=HV, mode="fwd+bwd" if args.training else "fwd")
        pieces = {bv: state_pieces(NAME, N=B, HV=HV, V=128, T=T, BT=64, value_tile=lambda n, bv=bv: bv,
                                   per_sm=state_programs_per_sm(bv)) for bv in bvs}
        results = {}
        for bv in bvs:
            use_bv(bv)
            with override(NAME, "state_pieces", value=pieces[bvs[0]]), poisoned_memory():
                results[bv] = forward(x, output_final_state=True)
        torch.cuda.synchronize()
        o0, ht0 = results[bvs[0]]
        for bv in bvs[1:]:
            o, ht = results[bv]
            record(dict(case, check=f"bv {bv} vs {bvs[0]}, {pieces[bvs[0]]} pieces", o_equal=torch.equal(o, o0),
                        state_equal=torch.equal(ht, ht0), o_nan=bool(o.isnan().any()),
                        o_max_abs=(o.float() - o0.float()).abs().max().item()))
        del results, o0, ht0
        if args.training:
            x = {n: (t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                 for n, t in x.items()}
        run = (lambda: train_step(x)) if args.training else (lambda: forward(x))
        for round_ in range(args.rounds):
            for bv in bvs:
                use_bv(bv)
                run()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
                record(dict(case, bv=bv, pieces=pieces[bv], round=round_, ms=round(ms, 4),
                            peak_mib=round(torch.cuda.max_memory_allocated() / 2**20)))
        if args.profile:
            for bv in bvs:
                use_bv(bv)
                record(dict(case, bv=bv, kernels_us=kernel_times(run)))
        GRAPHS.clear()


if __name__ == "__main__":
    main()
