"""The cached launch path (gdngen.runtime.launch.fast) against Triton's own, on one case (CUDA only).

    python benchmarks/fast_launch_check.py [--spec gated_delta_rule] [--case 8,2048,16,16] [--calls 50]

In one process, for the forward (no grad) and the forward+backward of the spec's chunk op in bf16,
with the cached path on (``set_fast(True)``) and off (``set_fast(False)``, every launch a plain
``kernel[grid](...)``):
- checks that the output and every input gradient are bitwise identical between the two;
- prints the host microseconds per call issuing ``--calls`` calls back to back without a sync,
  and the wall time per call to the end of the stream;
- checks that the timed calls of the cached path went through Triton zero times (all hits:
  no cache miss, no fallback to the plain path).
Exits 1 when anything differs, 0 otherwise.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--case", default="8,2048,16,16", help="B,T,H,HV")
    parser.add_argument("--calls", type=int, default=50, help="calls timed back to back (no sync between)")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    return parser.parse_args(argv)


def fast_launchers(module) -> list:
    """Every FastLaunch the generated module holds (alone or in a per-chunk-size dict)."""
    from gdngen.runtime.launch import FastLaunch
    found = []
    for value in vars(module).values():
        values = value.values() if isinstance(value, dict) else [value]
        found += [v for v in values if isinstance(v, FastLaunch)]
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("fast_launch_check: needs a CUDA GPU (the interpreter has no cached launch path)")
        return 0
    from gdngen import bench
    from gdngen.runtime import launch
    from gdngen.spec import load_spec

    spec = load_spec(f"specs/{args.spec}.yaml")
    module = importlib.import_module(f"generated.{args.spec}")
    op = bench.load_impls(["gdngen"], spec, module, "cuda")["gdngen"]
    B, T, H, HV = (int(n) for n in args.case.split(","))
    case = bench.Case(args.case, B, T, H, HV)
    launchers = fast_launchers(module)
    print(f"triton {launch.triton_version()}, {len(launchers)} fast launchers in generated.{args.spec}, "
          f"case {args.case} bf16", flush=True)
    if not launchers:
        print("no FastLaunch in the module: the cached path does not apply on this Triton (VERIFIED_TRITON)")
    failures = 0
    for mode in args.modes.split(","):
        grad = mode == "fwd+bwd"
        inputs = bench.make_inputs(spec, case, torch.bfloat16, "cuda", requires_grad=grad)
        leaves = {name: x for name, x in inputs.items() if x.requires_grad}
        do = torch.randn_like(op(inputs)) if grad else None

        def step():
            if grad:
                for x in leaves.values():
                    x.grad = None
                o = op(inputs)
                o.backward(do)
                return o
            with torch.no_grad():
                return op(inputs)

        results, timings, differing = {}, {}, 0
        for on in (True, False, True):
            launch.set_fast(on)
            for _ in range(3):                       # compile, then fill the launch caches
                step()
            torch.cuda.synchronize()
            o = step()
            torch.cuda.synchronize()
            outputs = {"o": o.detach().clone(), **{f"d{n}": x.grad.clone() for n, x in leaves.items()}}
            results.setdefault(on, []).append(outputs)
            misses = sum(fl.misses + fl.fallbacks for fl in launchers)
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            host = (time.perf_counter() - start) / args.calls
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.calls
            timed_misses = sum(fl.misses + fl.fallbacks for fl in launchers) - misses
            timings.setdefault(on, []).append((host, wall))
            if on and launchers and timed_misses:
                print(f"  {mode}: {timed_misses} timed launches went through Triton with the cached path on")
                failures += 1
        reference = results[False][0]
        for outputs in results[True]:
            for name, value in outputs.items():
                if not torch.equal(value, reference[name]):
                    diff = (value.float() - reference[name].float()).abs().max().item()
                    print(f"  {mode}: {name} differs between the cached and the plain path (max |diff| {diff:.3e})")
                    differing += 1
        for on, label in ((True, "fast"), (False, "plain")):
            host = min(h for h, _ in timings[on]) * 1e6
            wall = min(w for _, w in timings[on]) * 1e6
            print(f"{mode:8s} {label:6s} host {host:8.1f} us/call   wall {wall:8.1f} us/call", flush=True)
        print(f"{mode:8s} outputs and gradients ({', '.join(reference)}) "
              f"{'bitwise identical' if not differing else 'NOT identical'}", flush=True)
        failures += differing
        inputs = leaves = do = None          # free the case before the next mode
        torch.cuda.empty_cache()
    launch.set_fast(os.environ.get("GDNGEN_FAST_LAUNCH", "1") != "0")
    print("OK" if not failures else f"FAILED ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
