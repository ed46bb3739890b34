"""Why the tuner timed small no-grad forwards slower than the benchmark (CUDA only; stop 27).

    python benchmarks/tuner_timing_check.py [--cases "1,32768,2,8 8,2048,16,16"]

One process, the same generated op, do_bench medians of: the benchmark's call (gdngen.bench inputs, no
initial state, no final state), then one difference at a time towards the tuner's call
(gdngen.selfcheck inputs with an initial state, output_final_state=True, the stages pinned by override,
do_bench warmup 25 / rep 100 as the tuner's timer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton.testing  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1,32768,2,8 8,2048,16,16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernels", action="store_true", help="per-kernel device time with and without h0 instead")
    args = parser.parse_args()
    import importlib

    from gdngen import bench, selfcheck
    from gdngen.autotune.tuner import _pinned
    from gdngen.runtime import override
    from gdngen.runtime.tiles import default_tiles
    from gdngen.spec import load_spec
    spec = load_spec("specs/gated_delta_rule.yaml")
    fn = importlib.import_module("generated.gated_delta_rule").chunk_gated_delta_rule
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        case = bench.Case("", B, T, H, HV, 128, 128)
        x_bench = bench.make_inputs(spec, case, torch.bfloat16, "cuda")
        x_tuner = selfcheck.make_inputs(spec, B=B, T=T, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda")
        x_tuner_no_h0 = {k: v for k, v in x_tuner.items() if k != "initial_state"}
        sizes = dict(K=128, V=128, BT=64, N=B, HV=HV, dtype=torch.bfloat16)
        pinned = {s: default_tiles(s, **sizes) for s in ("wy", "state", "output", "state_output")}
        variants = {
            "bench inputs": (lambda: fn(**x_bench), 100, 400),
            "bench inputs, final state": (lambda: fn(**x_bench, output_final_state=True), 100, 400),
            "tuner inputs, no h0": (lambda: fn(**{k: v for k, v in x_tuner_no_h0.items() if k != "cu_seqlens"}), 100, 400),
            "tuner inputs": (lambda: fn(**{k: v for k, v in x_tuner.items() if k != "cu_seqlens"}, output_final_state=True), 100, 400),
        }

        def tuner_call():
            with _pinned(spec.name, pinned), override(spec.name, "fused_output", value=True):
                return fn(**{k: v for k, v in x_tuner.items() if k != "cu_seqlens"}, output_final_state=True, chunk_size=64)
        variants["tuner call"] = (tuner_call, 100, 400)
        variants["tuner call, tuner's do_bench"] = (tuner_call, 25, 100)
        if args.kernels:
            for name in ("tuner inputs, no h0", "tuner inputs"):
                row = dict(case=text, variant=name, kernels_us={k[:60]: round(v, 1) for k, v in kernel_times(variants[name][0]).items()})
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
            continue
        for name, (call, warmup, rep) in variants.items():
            with torch.no_grad():
                call()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")
            row = dict(case=text, variant=name, ms=ms)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


def kernel_times(call, reps=20, grad=False, before=None):
    """Per-kernel device us per call (torch.profiler) of a warmed-up call (under no_grad unless ``grad``:
    a training step). ``before``: run ahead of each profiled call (e.g. a cache flush); its kernels are in the
    result too, under their own names."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    with torch.set_grad_enabled(grad):
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                if before is not None:
                    before()
                call()
            torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / reps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    main()
