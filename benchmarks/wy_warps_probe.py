"""The forward's wy stage at its default warps against an override, in one process (CUDA only; stop 39).

    python benchmarks/wy_warps_probe.py [--cases "4,8192,16,32 1,32768,32,32 1,32768,2,8"] [--against 1] [--out rows.jsonl]
    python benchmarks/wy_warps_probe.py --switch NAME    # the default against override(spec, NAME, value=False)
                                                         # (stop 40: gates_in_wy, with its patch applied)
    python benchmarks/wy_warps_probe.py --tiles "maxnreg=168;maxnreg=128"   # the default against each
                                                         # override(spec, "wy", ...) (stop 43: register caps)

Stop 39's sweep timed one warp 0.547 ms against the default two's 0.605 for the whole (4,8192,16,32)
forward, without checking the output; ``--against 1`` checks it and times the other rows.

Per case: the no-grad forward's output and final state at the default wy tiles against ``num_warps=--against``
(the largest absolute and the relative L2 difference), then both timed with ``do_bench`` (median, two
rounds interleaved) and the wy kernel's device time (torch.profiler).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import no_grad_forward_cases, row_writer  # noqa: E402
from benchmarks.tuner_timing_check import kernel_times  # noqa: E402
from gdngen.runtime import override  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


def wy_us(fn) -> dict:
    """The forward wy kernel's device time per call (us), and every kernel's together."""
    times = kernel_times(fn)
    return dict(wy_us=sum(us for name, us in times.items() if name.startswith("_wy_fwd")),
                kernels_us=round(sum(times.values()), 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="4,8192,16,32 1,32768,32,32 1,32768,2,8")
    parser.add_argument("--against", type=int, default=1)
    parser.add_argument("--switch", default=None, help="compare override(spec, SWITCH, value=False) instead of warps")
    parser.add_argument("--tiles", default=None,
                        help="';'-separated variants of 'key=value,...' for override(spec, 'wy', ...) instead of warps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = row_writer(args.out)
    spec = load_spec("specs/gated_delta_rule.yaml")
    from generated.gated_delta_rule import chunk_gated_delta_rule as op
    for (B, T, H, HV), fwd in no_grad_forward_cases(op, args.cases):
        if args.switch:
            others = [(f"{args.switch}=False", lambda: override(spec.name, args.switch, value=False))]
        elif args.tiles:
            others = []
            for text_tiles in args.tiles.split(";"):
                config = {key: int(value) for key, value in (item.split("=") for item in text_tiles.split(","))}
                others.append((text_tiles, lambda config=config: override(spec.name, "wy", **config)))
        else:
            others = [(f"num_warps={args.against}", lambda: override(spec.name, "wy", num_warps=args.against))]
        o, ht = fwd()
        case = dict(B=B, T=T, H=H, HV=HV)
        for label, other in others:
            with other():
                o2, ht2 = fwd()
            record(dict(case, check=f"default against {label}",
                        o_max_abs=(o.float() - o2.float()).abs().max().item(),
                        o_rel_l2=((o.float() - o2.float()).norm() / o2.float().norm()).item(),
                        ht_max_abs=(ht - ht2).abs().max().item(), finite=bool(torch.isfinite(o2).all())))
        variants = [("default", contextlib.nullcontext)] + others
        for rnd in range(2):
            for label, tiles in variants:
                with tiles():
                    ms = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                    us = wy_us(fwd) if rnd == 0 else {}
                record(dict(case, variant=label, round=rnd, fwd_ms=round(ms, 4), **us))


if __name__ == "__main__":
    main()
