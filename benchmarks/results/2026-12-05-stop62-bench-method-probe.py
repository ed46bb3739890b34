"""Stop 62's probe (CUDA only): why `gdngen bench` reads the long forward rows slower than a longer do_bench of the
same call in the same session (H200, stop 62 call 1: 0.557 / 2.122 ms against 0.526 / 1.836 at (1,32768,32,32) /
(1,131072,16,32)).

The two measurements differ in four ways, each a variant here, timed in alternating order over a few rounds in
one process:
- `long`: the probe's timer (triton do_bench, warm-up 30 ms, 300 ms of calls), with the final state asked;
- `bench_timer`: the bench's timer (gdngen.bench.measure_ms: warm-up 25 ms, 100 ms of calls), final state asked;
- `bench_call`: that timer on the bench's call (no final state);
- `measure_row`: the bench's whole row (first call, a peak-memory call, then the timer), on the bench's call;
- `measure_row_clocks`: the same with the bench's clock log sampling nvidia-smi every 50 ms beside it.
FlashQLA (if it imports) is timed with the bench's timer each round, as the row beside it.

    python benchmarks/results/2026-12-05-stop62-bench-method-probe.py [--cases "1,131072,16,32 1,32768,32,32"]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import inputs, row_recorder  # noqa: E402
from gdngen.bench import ClockLog, gpu_id, measure_ms, measure_row  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,131072,16,32 1,32768,32,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from generated import gated_delta_rule as module
    try:
        from flash_qla import chunk_gated_delta_rule as flash_qla
    except Exception as exc:  # noqa: BLE001
        print(f"flashqla unavailable: {exc!r}"[:300])
        flash_qla = None
    record = row_recorder("bench-method.jsonl")

    def with_final(x):
        return module.chunk_gated_delta_rule(**x, output_final_state=True)

    def bench_call(x):
        return module.chunk_gated_delta_rule(**x)[0]

    for case in args.cases.split():
        B, T, H, HV = (int(n) for n in case.split(","))
        x = inputs(B, T, H, HV)

        def no_grad(op):
            def call():
                with torch.no_grad():
                    return op(x)
            return call

        variants = {
            "long": lambda: triton.testing.do_bench(no_grad(with_final), warmup=30, rep=300, return_mode="median"),
            "bench_timer": lambda: measure_ms(no_grad(with_final), "cuda"),
            "bench_call": lambda: measure_ms(no_grad(bench_call), "cuda"),
            "measure_row": lambda: measure_row(bench_call, x, "fwd", "cuda")["ms"],
        }

        def with_clocks():
            with ClockLog(gpu_id()) as clocks:
                row = measure_row(bench_call, x, "fwd", "cuda", clocks=clocks)
            return row["ms"], {k: row.get(k) for k in ("sm_mhz", "sm_mhz_min", "power_capped")}

        if flash_qla is not None:
            variants["flashqla"] = lambda: measure_ms(
                no_grad(lambda y: flash_qla(y["q"], y["k"], y["v"], y["g"], y["beta"])), "cuda")
        for call in (no_grad(with_final), no_grad(bench_call)):
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        names = list(variants) + ["measure_row_clocks"]
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                if name == "measure_row_clocks":
                    ms, clock = with_clocks()
                    record(case=case, round=round_, variant=name, ms=round(ms, 4), **clock)
                else:
                    record(case=case, round=round_, variant=name, ms=round(variants[name](), 4))
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
