"""What one Triton launch costs the host, by launch path (CUDA only).

    python benchmarks/launch_probe.py [--launches 2000]

A small kernel with a generated stage's argument shape (eight tensors, three ints, five constexprs)
is launched ``--launches`` times back to back through:
- ``jit``: ``kernel[grid](...)``, the path the generated modules take;
- ``compiled``: the CompiledKernel that first launch returned, ``compiled[grid](*args)``;
- ``run``: ``compiled.run`` with the stream and packed metadata looked up once;
- ``fast``: ``gdngen.runtime.launch.fast(kernel)[grid](...)``, the cached path the generated modules
  take (its key per call, then ``compiled.run`` with the current stream).
Prints host microseconds per launch for each, checks each path wrote the same output, then the
top functions of the ``jit`` and ``fast`` paths under cProfile.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gdngen.runtime.launch import FastLaunch, fast  # noqa: E402


@triton.jit
def _probe_kernel(a, b, c, d, e, f, g, out, n, T, scale,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BT + tl.arange(0, BT)
    mask = offs < n
    x = tl.load(a + offs, mask=mask, other=0.0)
    if FLAG:
        x = x * scale + T
    tl.store(out + offs, x + H + HV + K, mask=mask)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=2000)
    args = parser.parse_args()
    n = 4096
    tensors = [torch.randn(n, device="cuda") for _ in range(7)]
    out = torch.empty(n, device="cuda")
    grid = (triton.cdiv(n, 128), 1, 1)
    ints = (n, 7, 0.5)
    consts = dict(H=16, HV=32, K=128, BT=128, FLAG=True)

    def jit():
        return _probe_kernel[grid](*tensors, out, *ints, **consts)

    compiled = jit()
    torch.cuda.synchronize()
    expected = out.clone()
    all_args = (*tensors, out, *ints, *consts.values())
    runner = compiled[grid]
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    run = compiled.run
    function, packed = compiled.function, compiled.packed_metadata

    def via_compiled():
        runner(*all_args)

    def via_run():
        run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *all_args)

    cached = fast(_probe_kernel)
    if not isinstance(cached, FastLaunch):
        print(f"fast: not applicable on triton {triton.__version__} (plain path)")

    def via_fast():
        cached[grid](*tensors, out, *ints, **consts)

    for name, launch in (("jit", jit), ("compiled", via_compiled), ("run", via_run), ("fast", via_fast)):
        out.zero_()
        for _ in range(20):
            launch()
        torch.cuda.synchronize()
        ok = torch.equal(out, expected)
        start = time.perf_counter()
        for _ in range(args.launches):
            launch()
        host = (time.perf_counter() - start) / args.launches * 1e6
        torch.cuda.synchronize()
        print(f"{name:9s} {host:7.2f} us per launch (host), output {'equal' if ok else 'DIFFERENT'}", flush=True)
    if isinstance(cached, FastLaunch):
        print(f"fast: {cached.misses} launches through Triton to fill its cache, {cached.fallbacks} fallbacks")
    for name, launch in (("jit", jit), ("fast", via_fast)):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.launches):
            launch()
        profile.disable()
        torch.cuda.synchronize()
        print(f"---- cProfile of the {name} path")
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
