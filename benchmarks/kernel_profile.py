"""GPU time against host time, kernel by kernel, for each implementation of a case (CUDA only).

    python benchmarks/kernel_profile.py --cases "8,2048,16,16 1,32768,32,32" --impls gdngen,flashqla \
        [--modes fwd,fwd+bwd] [--calls 20] [--out rows.jsonl]

For every (case, mode, impl), after a warm-up:
- ``do_bench_ms``: the median of ``triton.testing.do_bench`` (what ``gdngen bench`` reports);
- ``host_ms``: the host's time per call issuing ``--calls`` steps back to back (no sync between);
- ``wall_ms``: the same steps to the end of the stream, per call;
- ``gpu_ms``: the kernels' summed device time per call (torch.profiler), and each kernel's share.
When ``host_ms`` exceeds ``gpu_ms`` the GPU waits on Python: launches, not kernels, set the time.
Each row is appended to ``--out`` as it is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from gdngen import bench  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


def steps_for(fn, inputs, mode):
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(inputs)
        return step, None
    leaves = [x for x in inputs.values() if x.requires_grad]
    do = torch.randn_like(fn(inputs))

    def step():
        fn(inputs).backward(do)
    return step, leaves


def profile_row(step, leaves, calls: int) -> dict:
    def clear():
        for x in leaves or ():
            x.grad = None

    for _ in range(3):
        step()
        clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
        clear()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls
    kernels = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
            clear()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_time_total > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.key[:80]] += event.device_time_total / calls   # us per call
    ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    return {"do_bench_ms": ms, "host_ms": host * 1e3, "wall_ms": wall * 1e3,
            "gpu_ms": sum(kernels.values()) / 1e3,
            "kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--cases", default="8,2048,16,16")
    parser.add_argument("--impls", default="gdngen,flashqla")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import importlib
    spec = load_spec(f"specs/{args.spec}.yaml")
    module = importlib.import_module(f"generated.{args.spec}")
    impls = bench.load_impls(args.impls.split(","), spec, module, "cuda")
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        case = bench.Case(text, B, T, H, HV)
        for mode in args.modes.split(","):
            for name, fn in impls.items():
                inputs = bench.make_inputs(spec, case, torch.bfloat16, "cuda", requires_grad=mode == "fwd+bwd")
                step, leaves = steps_for(fn, inputs, mode)
                row = {"impl": name, "mode": mode, "case": text, **profile_row(step, leaves, args.calls)}
                top = ", ".join(f"{k[:40]} {v:.0f}" for k, v in list(row["kernels_us"].items())[:8])
                print(f"{mode:8s} {name:9s} {text:16s} do_bench {row['do_bench_ms']:.3f} host {row['host_ms']:.3f} "
                      f"wall {row['wall_ms']:.3f} gpu {row['gpu_ms']:.3f} ms | {top}", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                del inputs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
