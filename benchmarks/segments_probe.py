"""The training step of ``gdngen bench`` (no final state, a random dO, time segments where the backward
takes them) with the Gluon reverse pass on and off, in time segments and in one call (stop 36: the bench's
fwd+bwd row at (1,32768,32,32) read 7.0 ms where gluon_state_probe.py's step read 4.78).

    python benchmarks/segments_probe.py [--case 1,32768,32,32] [--segments "default 1"] [--gluon "on off"]
        [--out rows.jsonl]

Per variant: do_bench's median (ms), peak memory of one step (peak allocated minus allocated before it, as
``gdngen bench`` reads it), the host and wall time per step of 20 steps issued back to back (host ~ wall:
host-bound; stop 42: ~0.5 ms of host per segment) and each kernel's device time (torch.profiler).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

NAME = "gated_delta_rule"


def step_figures(step, leaves, steps: int = 20) -> dict:
    """A training step's figures: do_bench's median (ms), the peak of one step over what was allocated before it
    (as ``gdngen bench`` reads it), what stays allocated after it with the leaves' gradients dropped, and the host
    and wall time per step of ``steps`` steps issued back to back (host ~ wall: host-bound)."""
    def clear():
        for x in leaves:
            x.grad = None

    clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    clear()
    held = torch.cuda.memory_allocated() / 2**20
    ms = triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median", grad_to_none=leaves)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
        clear()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return dict(ms=round(ms, 3), peak_mib=round(peak), allocated_after_mib=round(held),
                host_ms=round((issued - start) / steps * 1e3, 3), wall_ms=round((done - start) / steps * 1e3, 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="1,32768,32,32")
    parser.add_argument("--out", default=None)
    parser.add_argument("--segments", default="default 1", help='"default" or a count, space separated')
    parser.add_argument("--gluon", default="on off", help="the Gluon reverse pass: on, off or both")
    parser.add_argument("--dry", action="store_true", help="one step per variant on the CPU interpreter, no timing")
    args = parser.parse_args()
    from benchmarks.gluon_state_probe import kernel_times
    from gdngen.bench import Case, make_inputs
    from gdngen.runtime import override
    from gdngen.spec import load_spec
    import generated.gated_delta_rule as module
    spec = load_spec(str(ROOT / "specs" / f"{NAME}.yaml"))
    B, T, H, HV = (int(n) for n in args.case.split(","))
    device = "cpu" if args.dry else "cuda"
    inputs = make_inputs(spec, Case(args.case, B, T, H, HV, 128, 128), torch.float32 if args.dry else torch.bfloat16,
                         device, requires_grad=True)
    fn = module.chunk_gated_delta_rule
    do = torch.randn_like(fn(**inputs)[0])
    out = open(args.out, "a") if args.out else None
    for gluon in (word == "on" for word in args.gluon.split()):
        for segments in (None if word == "default" else int(word) for word in args.segments.split()):
            def step():
                with contextlib.ExitStack() as stack:
                    stack.enter_context(override(NAME, "gluon_state_bwd", value=gluon))
                    if segments:
                        stack.enter_context(override(NAME, "backward_segments", value=segments))
                    stack.enter_context(torch.enable_grad())     # (the profiler runs it under no_grad)
                    fn(**inputs)[0].backward(do)
            step()
            if args.dry:
                print(gluon, segments, "ran")
                continue
            row = dict(case=args.case, gluon_state_bwd=gluon, segments=segments or "default",
                       **step_figures(step, list(inputs.values())), kernels_us=kernel_times(step, 5))
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
