"""A training step (forward + backward) at the defaults against ``override(spec, SWITCH, value=False)``, in one
process (CUDA only; stop 41).

    python benchmarks/backward_switch_probe.py --switch gluon_chunk_bwd [--cases "4,8192,16,32 8,2048,16,16"] [--out rows.jsonl]

Per case: every gradient (q, k, v, g, beta) at the default against the switch turned off (the largest absolute
and the relative L2 difference, and whether it is finite), then both steps timed with ``do_bench`` (median, two
rounds interleaved) and, in the first round, each kernel's device time per step
(``tuner_timing_check.kernel_times``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import inputs, row_writer  # noqa: E402
from benchmarks.tuner_timing_check import kernel_times  # noqa: E402
from gdngen.runtime import override  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", required=True, help="an override name, e.g. gluon_chunk_bwd")
    parser.add_argument("--cases", default="4,8192,16,32 1,32768,32,32 8,2048,16,16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = row_writer(args.out)
    spec = load_spec("specs/gated_delta_rule.yaml")
    from generated.gated_delta_rule import chunk_gated_delta_rule as op
    names = ("q", "k", "v", "g", "beta")
    for text in args.cases.split():
        B, T, H, HV = (int(x) for x in text.split(","))
        x = inputs(B, T, H, HV, grad=True)
        do = torch.randn(B, T, HV, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()

        def step():
            for t in x.values():
                t.grad = None
            o, _ = op(**x)
            o.backward(do)

        def grads():
            step()
            return {n: x[n].grad.clone() for n in names}

        def off():
            return override(spec.name, args.switch, value=False)

        case = dict(B=B, T=T, H=H, HV=HV)
        on_grads = grads()
        with off():
            off_grads = grads()
        for n in names:
            a, b = on_grads[n].float(), off_grads[n].float()
            record(dict(case, check=f"default against {args.switch}=False", grad=n,
                        max_abs=(a - b).abs().max().item(), rel_l2=((a - b).norm() / b.norm()).item(),
                        finite=bool(torch.isfinite(a).all())))
        variants = (("default", contextlib.nullcontext), (f"{args.switch}=False", off))
        for rnd in range(2):
            for label, switch in variants:
                with switch():
                    ms = triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median")
                    times = kernel_times(step, reps=10, grad=True) if rnd == 0 else None
                    us = dict(kernels_us={k: round(v, 1) for k, v in times.items()}) if times else {}
                record(dict(case, variant=label, round=rnd, fwd_bwd_ms=round(ms, 4), **us))


if __name__ == "__main__":
    main()
