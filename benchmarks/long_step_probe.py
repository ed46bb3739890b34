"""A long training step (``gdngen bench``'s fwd+bwd: no final state, a random dO) eager or replayed as CUDA
graphs, in the default time segments or one: stop 45 (CUDA only).

    python benchmarks/long_step_probe.py [--cases "1,32768,32,32 4,8192,16,32"] [--variants "eager graphs"]
        [--segments "default 1"] [--out rows.jsonl]

Graph replay is bounded to calls of at most ``gdngen.runtime.graphs.MAX_WORK`` (B T HV K V) on the premise that
a longer call's host time hides behind its kernels; "graphs" lifts that bound for the probe. "1" segment lifts
the backward's segment budget (``gdngen.runtime.segments.SEGMENT_BUDGET_BYTES``) instead of an override, which
would turn graph replay off. Per variant: do_bench's median (ms), the host and wall time per step of 20 steps
issued back to back (host ~ wall: host-bound), the peak of one step over what was allocated before it, and what
stays allocated after it (the graphs' pools and outputs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NAME = "gated_delta_rule"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,32768,32,32 4,8192,16,32")
    parser.add_argument("--variants", default="eager graphs")
    parser.add_argument("--segments", default="default 1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from benchmarks.segments_probe import step_figures
    from gdngen.bench import Case, make_inputs
    from gdngen.runtime import graphs, segments as segments_module
    from gdngen.spec import load_spec
    import generated.gated_delta_rule as module
    spec = load_spec(str(ROOT / "specs" / f"{NAME}.yaml"))
    fn = module.chunk_gated_delta_rule
    bound, budget = graphs.MAX_WORK, segments_module.SEGMENT_BUDGET_BYTES
    out = open(args.out, "a") if args.out else None
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        inputs = make_inputs(spec, Case(text, B, T, H, HV, 128, 128), torch.bfloat16, "cuda", requires_grad=True)
        do = torch.randn_like(fn(**inputs)[0])
        leaves = list(inputs.values())

        def clear():
            for x in leaves:
                x.grad = None

        def step():
            fn(**inputs)[0].backward(do)

        for variant in args.variants.split():
            for seg in args.segments.split():
                graphs.GRAPHS.clear()
                graphs.MAX_WORK = 1 << 62 if variant == "graphs" else bound
                graphs.set_enabled(variant == "graphs")
                segments_module.SEGMENT_BUDGET_BYTES = 1 << 62 if seg == "1" else budget
                for _ in range(4):           # eager, capture, replays
                    step()
                    clear()
                row = dict(case=text, variant=variant, segments=seg, **step_figures(step, leaves),
                           graphs_kept=len(graphs.GRAPHS))
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
        graphs.GRAPHS.clear()
        del inputs, do
    graphs.MAX_WORK, segments_module.SEGMENT_BUDGET_BYTES = bound, budget
    graphs.set_enabled(True)


if __name__ == "__main__":
    main()
