"""gdngen's own host time per chunk-op call, on a CPU machine: the Python around the launches.

    python benchmarks/host_profile_cpu.py [--spec gated_delta_rule] [--shape 8,64,16,16] [--calls 200] [--rounds 7]
                                          [--dtype bfloat16] [--items] [--profile 25] [--gluon] [--segments S]

Runs under the Triton interpreter with every kernel launch made a no-op (nothing executes, outputs
stay uninitialised), so what is left is gdngen's host code and torch's (allocations, autograd).
By default it pretends the kernels run on an H200 the way the GPU path does: the device probe
returns an H200 (tile lookups go through the autotune cache and the shipped table) and the
compile-ahead check runs as for a CUDA tensor. ``--cpu-path`` keeps the interpreter's own path.

``--gluon`` takes the Gluon kernels' host path, as on a Hopper GPU: their usable checks answer yes and
their launches are no-ops too (the chunk and wy stages' descriptors are still built, on the host). ``--segments S`` forces the backward's time segments.

Prints microseconds per forward call and per forward+backward call; ``--items`` times each host
helper a call makes, replayed alone with the arguments it got (the sum per helper per call);
``--profile N`` prints cProfile's top N by cumulative time (``PROFILE_SORT=tottime``: by own time). Torch's CPU allocator is not CUDA's
caching allocator: the allocation line is a CPU figure, and the default shape is (8, 64, 16, 16), which
takes the host path of (8, 2048, 16, 16) (same tile buckets, state pass in one piece, the T path) with
tensors small enough for the heap (past 32 MiB each allocation is an mmap whatever the threshold).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import sys
import time
from collections import defaultdict

# glibc hands allocations past its (moving) mmap threshold to mmap / munmap on every call, whose cost
# swings by tens of microseconds between runs; a fixed threshold keeps them on the heap, steady, as
# CUDA's caching allocator is. Read at process start: set, then run again.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
if any(os.environ.get(name) != value for name, value in _MALLOC.items()):
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **_MALLOC})
os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def _no_launch(self, *args, grid, warmup, **kwargs):
    return None


# helpers a generated module calls by name; --items wraps each in the module's namespace
HELPERS = ("validate_chunk_call", "check_backend", "contiguous", "dot_precision", "tiles", "store_wu", "state_pieces",
           "boundary_hooks", "compile_first_call", "backward_tiles", "backward_segments", "present", "absent",
           "next_pow2", "chunk_state_rows")


def _inputs(B, T, H, HV, K, V, dtype):
    return dict(q=torch.randn(B, T, H, K, dtype=dtype), k=F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype),
                v=torch.randn(B, T, HV, V, dtype=dtype), g=F.logsigmoid(torch.randn(B, T, HV)),
                beta=torch.rand(B, T, HV, dtype=dtype), initial_state=torch.zeros(B, HV, K, V))


def _per_call(step, calls: int) -> float:
    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls * 1e6


def _replay(fn, args, kwargs, repeats: int, rounds: int = 5) -> float:
    """us per call: the best of ``rounds`` rounds (the least disturbed by other work on the machine)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best / repeats * 1e6


def _replay_items(module, step, repeats: int = 200) -> dict:
    """Each helper's calls during one ``step``, replayed ``repeats`` times alone: us per step.

    Besides the module's helpers: torch.empty / empty_like / zeros_like (allocations), triton.cdiv,
    the kernel launches (no-op here: the interpreter's ``kernel[grid](...)`` path alone, not
    Triton's GPU launch), and the autograd wrapper (``Function.apply`` less the forward it runs,
    with ``inspect.signature`` apart)."""
    import inspect

    import triton
    seen = []
    patched = [(module, name, getattr(module, name)) for name in HELPERS if hasattr(module, name)]
    patched += [(torch, name, getattr(torch, name)) for name in ("empty", "empty_like", "zeros_like")]
    patched += [(triton, "cdiv", triton.cdiv), (InterpretedFunction, "run", InterpretedFunction.run)]

    def wrap(label, fn):
        def recorder(*args, **kwargs):
            seen.append((label, fn, args, kwargs))
            return fn(*args, **kwargs)
        return recorder

    for owner, name, fn in patched:
        label = "launch (no-op)" if name == "run" else f"torch.{name}" if owner is torch else \
            "triton.cdiv" if owner is triton else name
        setattr(owner, name, wrap(label, fn))
    try:
        step()
    finally:
        for owner, name, fn in patched:
            setattr(owner, name, fn)
    totals, counts = defaultdict(float), defaultdict(int)
    for name, fn, args, kwargs in seen:
        if name == "launch (no-op)":
            kernel, rest = args[0], args[1:]
            grid = kwargs.pop("grid")
            kwargs.pop("warmup")
            us = _replay(kernel[grid], rest, kwargs, repeats)
        else:
            us = _replay(fn, args, kwargs, repeats)
        label = name + (f"[{args[1]}]" if name == "tiles" else f"[{args[0]}]" if name == "backward_tiles" else "")
        totals[label] += us
        counts[label] += 1
    eager = next((getattr(module, n) for n in dir(module) if n.endswith("_eager") and n.startswith("_chunk")), None)
    if eager is not None:
        impl_name = eager.__name__[:-len("_eager")] + "_forward_impl"
        impl, forward = getattr(module, impl_name), eager.forward
        captured, applied = [], []
        setattr(module, impl_name, lambda *inputs: captured.append(inputs) or impl(*inputs))
        eager.forward = staticmethod(lambda *inputs: applied.append(1) or forward(*inputs))
        try:
            step()
        finally:
            setattr(module, impl_name, impl)
            eager.forward = staticmethod(forward)
        if applied:
            inputs = captured[0]
            grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
            with torch.enable_grad() if grad else torch.no_grad():
                wrapper = _replay(eager.apply, inputs, {}, repeats) - _replay(impl, inputs, {}, repeats)
            sig = _replay(lambda: inspect.signature(eager.forward).bind(*inputs), (), {}, repeats)
            totals["autograd Function.apply"], counts["autograd Function.apply"] = wrapper, 1
            totals["  of which inspect.signature"], counts["  of which inspect.signature"] = sig, 1
        else:
            totals["autograd Function.apply (skipped)"], counts["autograd Function.apply (skipped)"] = 0.0, 0
    return {label: (totals[label], counts[label]) for label in totals}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--shape", default="8,64,16,16")
    parser.add_argument("--dims", default="128,128", help="K,V")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of --calls; the best counts (a busy machine)")
    parser.add_argument("--cpu-path", action="store_true", help="no pretend H200: the interpreter's own path")
    parser.add_argument("--items", action="store_true")
    parser.add_argument("--gluon", action="store_true",
                        help="take the Gluon passes' host path (Hopper): their usable checks answer yes, launches no-op")
    parser.add_argument("--segments", type=int, default=0, help="force the backward's time segments (override)")
    parser.add_argument("--profile", type=int, default=0)
    args = parser.parse_args()
    InterpretedFunction.run = _no_launch
    B, T, H, HV = (int(n) for n in args.shape.split(","))
    K, V = (int(n) for n in args.dims.split(","))
    dtype = getattr(torch, args.dtype)
    if not args.cpu_path:
        from gdngen.autotune import device as device_mod
        from gdngen.runtime import precompile
        h200 = device_mod.DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)
        device_mod.set_probe(lambda: h200)
        precompile.enabled = lambda x: os.environ.get("GDNGEN_COMPILE_AHEAD", "1") != "0"
        torch.cuda.current_device = lambda: 0     # the compile-ahead key's device (its dry run compiles nothing here)
    module = importlib.import_module(f"generated.{args.spec}")
    fn = getattr(module, f"chunk_{args.spec}")
    if args.gluon:
        class NoLaunch:
            def __getitem__(self, grid):
                return lambda *a, **kw: None
        for name in ("state_pass_usable", "state_bwd_usable", "chunk_bwd_usable", "wy_bwd_usable"):
            if hasattr(module, name):
                setattr(module, name, lambda *a, **kw: True)
        for name in ("_state_output_gluon_fast", "_state_bwd_gluon_fast", "_chunk_bwd_gluon_fast", "_wy_bwd_gluon_fast"):
            if hasattr(module, name):
                setattr(module, name, NoLaunch())
        # the chunk and wy stages' host-built descriptors, on CPU tensors (Gluon's class checks no device)
        module.ensure_scratch_allocator = lambda: None      # (allocates through CUDA)
    if args.segments:
        from gdngen.runtime import override
        override(args.spec, "backward_segments", value=args.segments).__enter__()
    x = _inputs(B, T, H, HV, K, V, dtype)
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    ones = None

    def forward():
        with torch.no_grad():
            return fn(**x, output_final_state=True)

    def train():
        nonlocal ones
        o, h = fn(**leaves, output_final_state=True)
        if ones is None:
            ones = (torch.ones_like(o), torch.ones_like(h))
        torch.autograd.grad([o, h], list(leaves.values()), ones)

    print(f"{args.spec} (B,T,H,HV)=({B},{T},{H},{HV}) K={K} V={V} {args.dtype}, launches no-op, "
          f"{'CPU interpreter path' if args.cpu_path else 'pretend H200'}")
    for name, step in (("forward", forward), ("forward+backward", train)):
        best = min(_per_call(step, args.calls) for _ in range(args.rounds))
        print(f"{name:17s} {best:8.1f} us per call (best of {args.rounds} x {args.calls})", flush=True)
        if args.items:
            items = _replay_items(module, step)
            for label, (us, count) in sorted(items.items(), key=lambda kv: -kv[1][0]):
                print(f"    {label:28s} {us:7.2f} us  ({count} calls)")
            known = sum(us for label, (us, _) in items.items() if not label.startswith(" "))
            print(f"    {'sum of the above':28s} {known:7.2f} us")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                step()
            profile.disable()
            pstats.Stats(profile).sort_stats(os.environ.get("PROFILE_SORT", "cumulative")).print_stats(args.profile)


if __name__ == "__main__":
    main()
