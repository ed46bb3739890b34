"""Two renderings of gated_delta_rule's forward + backward side by side in one process (CUDA only; stop 38).

    python benchmarks/module_ab.py --modules "variant_tmp/gdr_head.py generated/gated_delta_rule.py" \
        [--cases "4,8192,16,32 1,32768,32,32"] [--bwd-tiles "wy:BV=128 wy:num_warps=8"] [--profile] [--out rows.jsonl]

Per case: every gradient (q, k, v, g, beta) of each module against the first module's, as the relative
L2 difference and the largest absolute one (NaN-poisoned buffers); then fwd+bwd times (``do_bench``
medians, modules interleaved over two rounds, the second in reverse order), peak memory, and with
``--profile`` each kernel's device time: the median over ``--profile-rounds`` rounds whose order alternates.
One unchanged kernel profiled once per module in a fixed order read 364-403 us by its place (stop 51); the
first round after the timed runs is the slow one, so a single round favours whichever module comes later.
``--bwd-tiles`` adds rows of the last module with one backward stage's launch parameters overridden
(``override_backward``), each with its gradients' difference to the default tiles'. ``--switches`` adds rows of
the last module with ``gdngen.runtime.override`` switches set, one row per space-separated group of
comma-separated ``name=0|1`` (e.g. ``"gluon_one_chain_bwd=1 gluon_one_chain_bwd=1,gluon_reverse_wy=1"``: the
one-chain reverse pass, then with the wy stage in it), profiled beside the modules. An override keeps a call off
CUDA graphs (gdngen.runtime.graphs), so a switch row's do_bench is an eager call where the modules' rows may
replay: compare its kernel times (``--profile``), not its ms (stop 63: 1.8 against 0.64 ms at (8,2048,16,16) for
the same kernels).
A template change is measured by rendering main's module into an untracked file
(``git show HEAD:generated/gated_delta_rule.py > variant_tmp/gdr_head.py``) beside the working tree's.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402


def parse_override(text: str):
    """"stage:KEY=value,KEY=value" -> (stage, {KEY: int})."""
    stage, _, fields = text.partition(":")
    return stage, {key: int(value) for key, value in (f.split("=") for f in fields.split(",") if f)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", required=True, help="module files, space separated (the first is the baseline)")
    parser.add_argument("--cases", default="4,8192,16,32 1,32768,32,32 8,2048,16,16")
    parser.add_argument("--bwd-tiles", default="", help='e.g. "wy:BV=128,num_warps=8 chunk:BK=64,BV=128"')
    parser.add_argument("--switches", default="",
                        help='e.g. "gluon_one_chain_bwd=1 gluon_one_chain_bwd=1,gluon_reverse_wy=1" (override switches)')
    parser.add_argument("--modes", default="fwd+bwd", help='"fwd+bwd", "fwd" (no grad) or both, space separated')
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rounds", type=int, default=4,
                        help="profile rounds, the modules' order reversed every other round (medians per kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.profile_rounds < 1:
        parser.error(f"--profile-rounds: at least 1, got {args.profile_rounds}")
    from benchmarks.fused_probe import inputs, load_module, row_writer
    from benchmarks.tuner_timing_check import kernel_times
    from gdngen.runtime import override as override_switch
    from gdngen.runtime.backward_tiles import override_backward
    from gdngen.runtime.graphs import GRAPHS, set_enabled as set_graphs
    from gdngen.selfcheck import poisoned_memory
    paths = args.modules.split()
    modules = [load_module(ROOT / p, f"gdr_variant_{i}") for i, p in enumerate(paths)]
    overrides = [parse_override(t) for t in args.bwd_tiles.split()]
    switches = [[(name, int(value)) for name, _, value in (item.partition("=") for item in group.split(","))]
                for group in args.switches.split()]
    record = row_writer(args.out)

    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        case = dict(B=B, T=T, H=H, HV=HV)
        x = inputs(B, T, H, HV, grad=True)
        leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(B, T, HV, 128, device="cuda", generator=gen).bfloat16()
        # (label, module, what the call runs under)
        variants = [(p, m, contextlib.nullcontext) for p, m in zip(paths, modules)]
        def switched(group):
            stack = contextlib.ExitStack()
            for name, value in group:
                stack.enter_context(override_switch("gated_delta_rule", name, value=value))
            return stack
        variants += [(f"{paths[-1]} " + ",".join(f"{name}={int(value)}" for name, value in group), modules[-1],
                      lambda group=group: switched(group)) for group in switches]
        profiled = variants[:]
        variants += [(f"{paths[-1]} {stage}:{cfg}", modules[-1],
                      lambda stage=stage, cfg=cfg: override_backward(stage, **cfg)) for stage, cfg in overrides]

        def step(module, override):
            # (enable_grad: the profiler's caller may not)
            with override(), torch.enable_grad():
                o, _ = module.chunk_gated_delta_rule(**x)
                return torch.autograd.grad(o, leaves, do)

        def forward(module, override):
            with override(), torch.no_grad():
                return module.chunk_gated_delta_rule(**x, output_final_state=True)

        base = None
        for label, module, override in variants:
            with poisoned_memory():
                grads = step(module, override)
            torch.cuda.synchronize()
            if base is None:
                base = grads
            diff = {n: dict(rel_l2=((a.float() - b.float()).norm() / b.float().norm()).item(),
                            max_abs=(a.float() - b.float()).abs().max().item(), nan=bool(a.isnan().any()))
                    for n, a, b in zip(("q", "k", "v", "g", "beta"), grads, base)}
            record(dict(case, variant=label, check="grads vs the first module", diff=diff))
        if "fwd" in args.modes.split():
            outputs = []
            for label, module, override in profiled:
                with poisoned_memory():
                    outputs.append(forward(module, override))
                torch.cuda.synchronize()
                (o, ht), (o0, ht0) = outputs[-1], outputs[0]
                record(dict(case, variant=label, check="no-grad o, final state vs the first module's",
                            o_equal=torch.equal(o, o0), state_equal=torch.equal(ht, ht0), o_nan=bool(o.isnan().any())))
            del outputs
        # (every rendering's op has the same name: graphs replayed for one must not serve another)
        for mode in args.modes.split():
            fn = step if mode == "fwd+bwd" else forward
            timed = variants if mode == "fwd+bwd" else profiled
            for round_ in range(2):
                for label, module, override in (timed if round_ % 2 == 0 else timed[::-1]):
                    def run(module=module, override=override):
                        fn(module, override)
                    GRAPHS.clear()
                    run()
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(run, warmup=30, rep=300, return_mode="median")
                    record(dict(case, variant=label, mode=mode, round=round_, ms=round(ms, 4),
                                peak_mib=torch.cuda.max_memory_allocated() >> 20))
            if args.profile:             # (eager: each kernel on its own in the profile)
                set_graphs(False)
                rounds = {label: [] for label, _, _ in profiled}
                # rounds in alternating order, medians per kernel: profiled one after another in a fixed order,
                # one unchanged kernel read 364-403 us by its place in the order (stop 51)
                for round_ in range(args.profile_rounds):
                    for label, module, override in (profiled if round_ % 2 == 0 else profiled[::-1]):
                        rounds[label].append(kernel_times(lambda: fn(module, override), reps=10))
                for label, _, _ in profiled:
                    names = {name for times in rounds[label] for name in times}
                    medians = {name[:40]: round(statistics.median(times.get(name, 0.) for times in rounds[label]), 1)
                               for name in names}
                    record(dict(case, variant=label, mode=mode, rounds=args.profile_rounds,
                                kernels_us=dict(sorted(medians.items(), key=lambda kv: -kv[1])),
                                total_us_by_round=[round(sum(times.values()), 1) for times in rounds[label]]))
                set_graphs(True)
        GRAPHS.clear()


if __name__ == "__main__":
    main()
