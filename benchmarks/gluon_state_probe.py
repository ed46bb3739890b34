"""GDN's fused forward state pass in Gluon (stages/state_gluon.py.j2) beside the Triton template's
(CUDA sm_90 only; stop 34).

    python benchmarks/gluon_state_probe.py [--cases "1,32768,32,32 ..."] [--profile] [--training] [--out rows.jsonl]

Per case: a check (NaN-poisoned buffers: o and the final state of the Gluon pass against the Triton
pass over the same pieces, bit for bit), then the no-grad forward's time both ways (``do_bench``
medians, two rounds), and with ``--profile`` each kernel's device time (torch.profiler) and the host's
time per call. Last, o's error against float64 at (1, 4096, 16, 32) both ways. ``--training`` times
forward + backward instead, with ``override(spec, "gluon_training", value=False)`` against the default
(stop 35: the training forward's Gluon pass writes o beside h and V_new).

Stop 34's first version carried its own copy of the kernel and swapped it in for the module's fused
launch (benchmarks/results/2026-12-02-h200-stop34-call{1,2}-*); the kernel now lives in the template and
the module picks it (gdngen.runtime.gluon.state_pass_usable), so this compares
``override(spec, "gluon_state", value=False)`` with the default.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

NAME = "gated_delta_rule"


def kernel_times(run, reps=20):
    """Per-kernel device time (us per call, torch.profiler) of ``run``: tuner_timing_check's, rounded."""
    from benchmarks.tuner_timing_check import kernel_times as profiled
    return {name[:40]: round(us, 1) for name, us in profiled(run, reps).items()}


def host_ms(run, calls=30):
    """Host time per call, back to back with no synchronisation (the launches only)."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * elapsed / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,32768,32,32 4,8192,16,32 8,2048,16,16 1,131072,16,32 1,32768,2,8")
    parser.add_argument("--profile", action="store_true", help="per-kernel device time and host time too")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-precision", action="store_true")
    parser.add_argument("--training", action="store_true",
                        help="time forward + backward, the training forward through the Gluon pass or not")
    parser.add_argument("--switch", default="gluon_training",
                        choices=("gluon_training", "gluon_state_bwd", "gluon_w_from_t"),
                        help="with --training: the switch timed on and off (gluon_state_bwd: the backward's reverse "
                             "state pass in Gluon; gluon_w_from_t: that pass forms W from T, no wy_prep)")
    parser.add_argument("--module-file", default=None,
                        help="time this rendering of the module instead (an earlier template's, for A/B rows)")
    args = parser.parse_args()
    from benchmarks.fused_probe import inputs
    from gdngen.runtime import override
    from gdngen.runtime.tiles import state_pieces
    from gdngen.selfcheck import poisoned_memory
    if args.module_file:
        module_spec = importlib.util.spec_from_file_location(f"{NAME}_variant", args.module_file)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(f"generated.{NAME}")
    fn = module.chunk_gated_delta_rule
    launches = []
    original = module._state_output_gluon

    def counting(*a, **kw):
        launches.append(inspect.signature(original).bind(*a, **kw).arguments["N"])
        return original(*a, **kw)
    module._state_output_gluon = counting
    out = open(args.out, "a") if args.out else None

    def record(row):
        row = dict(row, module=args.module_file or f"generated/{NAME}.py")
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    def forward(x, gluon, pieces=None, **kw):
        with contextlib.ExitStack() as stack:
            stack.enter_context(override(NAME, "gluon_state", value=gluon))
            if pieces:
                stack.enter_context(override(NAME, "state_pieces", value=pieces))
            with torch.no_grad():
                return fn(**x, **kw)

    def train_step(x, gluon):
        """One forward + backward with ``args.switch`` (a Gluon pass in the training step) on or off."""
        with override(NAME, args.switch, value=gluon), torch.enable_grad():    # (the profiler's caller may not)
            o, ht = fn(**x, output_final_state=True)
            torch.autograd.backward((o, ht), (torch.ones_like(o), torch.ones_like(ht)))

    def timed(x, gluon):
        def run():
            return train_step(x, gluon) if args.training else forward(x, gluon)
        run()
        torch.cuda.synchronize()
        return triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")

    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        x = inputs(B, T, H, HV)
        case = dict(B=B, T=T, H=H, HV=HV)
        pieces = state_pieces(NAME, N=B, HV=HV, V=128, T=T, BT=64, value_tile=lambda n: 128, per_sm=1)
        del launches[:]
        with poisoned_memory():
            o, ht = forward(x, True, output_final_state=True)
            o_triton, ht_triton = forward(x, False, pieces, output_final_state=True)
        torch.cuda.synchronize()
        record(dict(case, variant="check: gluon vs triton, same pieces", pieces=pieces, gluon_launches=list(launches),
                    o_equal=torch.equal(o, o_triton), state_equal=torch.equal(ht, ht_triton),
                    o_nan=bool(o.isnan().any()), o_max_abs=(o.float() - o_triton.float()).abs().max().item()))
        del o, ht, o_triton, ht_triton
        mode = f"fwd+bwd ({args.switch})" if args.training else "fwd"
        if args.training:
            x = {n: (t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                 for n, t in x.items()}
        for round_ in range(2):
            for label, gluon in ((f"triton {mode}", False), (f"gluon {mode}", True)):
                torch.cuda.reset_peak_memory_stats()
                ms = timed(x, gluon)
                record(dict(case, variant=label, round=round_, ms=ms,
                            peak_mib=round(torch.cuda.max_memory_allocated() / 2**20)))
        if args.profile:
            for label, gluon in ((f"triton {mode}", False), (f"gluon {mode}", True)):
                def run():
                    return train_step(x, gluon) if args.training else forward(x, gluon)
                record(dict(case, variant=label, kernels_us=kernel_times(run), host_ms=host_ms(run)))
    if not args.no_precision:
        from gdngen.reference import run as reference_run
        from gdngen.spec import load_spec
        spec = load_spec(str(ROOT / "specs" / f"{NAME}.yaml"))
        x = inputs(1, 4096, 16, 32, seed=3)
        ref, _ = reference_run(spec, *(x[n].double().cpu() for n in ("q", "k", "v", "g", "beta")), form="chunked",
                               chunk_size=64)
        for label, gluon in (("triton", False), ("gluon", True)):
            del launches[:]
            o, _ = forward(x, gluon)
            err = ((o.double().cpu() - ref).norm() / ref.norm()).item()
            record(dict(B=1, T=4096, H=16, HV=32, variant=f"{label} precision", rel_l2=err, gluon_launches=list(launches)))


if __name__ == "__main__":
    main()
