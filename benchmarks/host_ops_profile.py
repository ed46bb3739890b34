"""Where the host time of one call goes, op by op, on the GPU machine (CUDA only).

    python benchmarks/host_ops_profile.py [--case 8,2048,16,16] [--modes fwd,fwd+bwd] [--calls 30] [--top 40]

``host_profile.py`` (cProfile) sees Python functions only, and inflates them; ``host_profile_cpu.py``
runs the Python with launches made no-ops on CPU tensors. Neither shows what the CUDA side of the host
costs: the driver calls behind a launch, the caching allocator, the autograd engine's CUDA work.
This runs the benchmark's step (``gdngen bench``'s inputs, ``fn(inputs).backward(do)`` with the
gradients cleared) under torch.profiler with CPU and CUDA activities and prints, per call, the host
time back to back without the profiler, then the profiler's ops and CUDA runtime calls by self CPU
time (``cudaLaunchKernel``, ``cuLaunchKernel``, ``aten::empty``, ``autograd::engine::...``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gdngen import bench  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


def shares(step, calls: int, host_us: float) -> str:
    """Per call: the host time inside the cached launches and inside torch.empty, timed around
    each call with perf_counter (a wrapper's own cost, ~0.3 us a call, is counted in)."""
    from gdngen.runtime import launch
    from triton.backends.nvidia.driver import CudaLauncher
    spent = {"launch": [0.0, 0], "of which Triton's launcher": [0.0, 0], "torch.empty": [0.0, 0]}
    original_launch, original_empty, original_launcher = launch.FastLaunch._launch, torch.empty, CudaLauncher.__call__

    def timed_launcher(self, *args):
        start = time.perf_counter()
        try:
            return original_launcher(self, *args)
        finally:
            spent["of which Triton's launcher"][0] += time.perf_counter() - start
            spent["of which Triton's launcher"][1] += 1

    def timed_launch(self, grid, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original_launch(self, grid, *args, **kwargs)
        finally:
            spent["launch"][0] += time.perf_counter() - start
            spent["launch"][1] += 1

    def timed_empty(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_empty(*args, **kwargs)
        finally:
            spent["torch.empty"][0] += time.perf_counter() - start
            spent["torch.empty"][1] += 1

    launch.FastLaunch._launch, torch.empty, CudaLauncher.__call__ = timed_launch, timed_empty, timed_launcher
    try:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        for item in spent.values():
            item[:] = [0.0, 0]
        start = time.perf_counter()
        for _ in range(calls):
            step()
        total = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    finally:
        launch.FastLaunch._launch, torch.empty, CudaLauncher.__call__ = original_launch, original_empty, original_launcher
    parts = ", ".join(f"{name} {t / calls * 1e6:.1f} us in {n // calls} calls ({t / max(n, 1) * 1e6:.1f} us each)"
                      for name, (t, n) in spent.items())
    return f"host {total:.1f} us per call with the timers ({host_us:.1f} without): {parts}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--case", default="8,2048,16,16")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--shares", action="store_true",
                        help="also time, back to back without the profiler, the host time spent inside gdngen's "
                             "cached launches (FastLaunch._launch, the Triton launcher included) and torch.empty")
    args = parser.parse_args()
    import importlib
    spec = load_spec(f"specs/{args.spec}.yaml")
    module = importlib.import_module(f"generated.{args.spec}")
    fn = bench.load_impls(["gdngen"], spec, module, "cuda")["gdngen"]
    B, T, H, HV = (int(n) for n in args.case.split(","))
    case = bench.Case(args.case, B, T, H, HV)
    for mode in args.modes.split(","):
        inputs = bench.make_inputs(spec, case, torch.bfloat16, "cuda", requires_grad=mode == "fwd+bwd")
        leaves = [x for x in inputs.values() if x.requires_grad]
        do = torch.randn_like(fn(inputs)) if leaves else None

        def step():
            if leaves:
                fn(inputs).backward(do)
                for x in leaves:
                    x.grad = None
            else:
                with torch.no_grad():
                    fn(inputs)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            step()
        host = (time.perf_counter() - start) / args.calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.calls * 1e6
        if args.shares:
            print(f"== {mode} {args.case}: {shares(step, args.calls, host)}", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.calls):
                step()
            torch.cuda.synchronize()
        print(f"== {mode} {args.case}: host {host:.1f} us per call back to back, wall {wall:.1f} us "
              f"(no profiler); profiler rows below are totals over {args.calls} calls", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60),
              flush=True)


if __name__ == "__main__":
    main()
