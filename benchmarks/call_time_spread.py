"""Per-call time spread of each implementation's no-grad forward, one process (CUDA only; stop 51).

    python benchmarks/call_time_spread.py --impls gdngen,flashqla --cases "1,32768,32,32 1,131072,16,32" \
        [--calls 100] [--rounds 3] [--out rows.jsonl]

``gdngen bench`` reports one ``do_bench`` median a row. This times every call on its own, as do_bench does (the L2
cleared by a 256 MB write before it, CUDA events around it), ``--calls`` calls a round, and reports the spread:
percentiles over all calls and each round's median. A round's median against another's shows whether a row's time
moves within a process (stop 51: gdngen's (1,32768,32,32) forward read 0.50-0.61 ms in windows of about a second,
with identical code, inputs and addresses, while (4,8192,16,32) stayed within 0.485-0.500).
Each row is appended to ``--out`` as it is measured.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PERCENTILES = (0.05, 0.25, 0.5, 0.75, 0.95, 1.0)


def summarise(times_ms: list[float], calls_per_round: int) -> dict:
    """Percentiles (nearest rank, p05 .. p100 as ``p05`` .. ``max``) of all calls' times and each round's median;
    ``times_ms`` in call order, ``calls_per_round`` calls a round."""
    if not times_ms:
        raise ValueError("times_ms: no calls timed")
    if calls_per_round < 1 or len(times_ms) % calls_per_round:
        raise ValueError(f"calls_per_round: {calls_per_round} does not divide {len(times_ms)} calls")
    ordered = sorted(times_ms)

    def rank(p: float) -> float:
        return round(ordered[round(p * (len(ordered) - 1))], 4)

    names = {0.05: "p05", 0.25: "p25", 0.5: "p50", 0.75: "p75", 0.95: "p95", 1.0: "max"}
    rounds = [sorted(times_ms[i:i + calls_per_round]) for i in range(0, len(times_ms), calls_per_round)]
    return dict({names[p]: rank(p) for p in PERCENTILES}, calls=len(times_ms),
                round_medians=[round(r[len(r) // 2], 4) for r in rounds])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="gdngen,flashqla")
    parser.add_argument("--cases", default="1,32768,32,32 4,8192,16,32")
    parser.add_argument("--calls", type=int, default=100, help="calls a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    from gdngen.bench import Case, load_impls, make_inputs
    from gdngen.spec import load_spec
    import generated.gated_delta_rule as module
    from benchmarks.fused_probe import row_writer
    spec = load_spec(ROOT / "specs" / "gated_delta_rule.yaml")
    impls = load_impls(args.impls.split(","), spec, module, "cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")       # do_bench's L2 clear
    record = row_writer(args.out)
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        inputs = make_inputs(spec, Case(name=text, B=B, T=T, H=H, HV=HV), torch.bfloat16, "cuda")
        for name, fn in impls.items():
            with torch.no_grad():
                start = time.perf_counter()
                fn(inputs)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
                for _ in range(10):
                    fn(inputs)
                times = []
                for _ in range(args.rounds):
                    begins = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls)]
                    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls)]
                    for i in range(args.calls):
                        flush.zero_()
                        begins[i].record()
                        fn(inputs)
                        ends[i].record()
                    torch.cuda.synchronize()
                    times += [b.elapsed_time(e) for b, e in zip(begins, ends)]
            record(dict(case=text, impl=name, first_s=round(first_s, 1), **summarise(times, args.calls)))


if __name__ == "__main__":
    main()
