"""Why a no-grad forward's do_bench time can exceed its back-to-back wall time (CUDA only; stop 43).

    python benchmarks/fwd_timing_probe.py --cases "1,32768,32,32 4,8192,16,32" [--pieces 1,4] [--out rows.jsonl]

Per case (and per forced piece count, override(spec, "state_pieces", value=P)): the forward once under
torch.cuda.set_sync_debug_mode("error") (a synchronising call raises), then timed three ways:
- ``do_bench_ms``: triton.testing.do_bench's median (an L2 flush before each call; what gdngen bench reports);
- ``queued_ms``: CUDA events around one call issued while the GPU sleeps (torch.cuda._sleep), so every launch
  is queued before the first kernel runs: the GPU's own time, no host gap inside the call;
- ``flushed_queued_ms``: the same after the L2 flush do_bench uses.
``do_bench_ms`` well above ``queued_ms`` means the host issues the launches more slowly than the GPU runs them.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import no_grad_forward_cases, row_writer  # noqa: E402
from gdngen.runtime import override  # noqa: E402


def queued_ms(fn, flush=None, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)          # ~1 ms of GPU time: the call's launches queue behind it
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,32768,32,32 4,8192,16,32")
    parser.add_argument("--pieces", default="", help="comma-separated forced piece counts (default: only the default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = row_writer(args.out)
    from generated.gated_delta_rule import chunk_gated_delta_rule as op
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for (B, T, H, HV), fwd in no_grad_forward_cases(op, args.cases):
        variants = [("default", contextlib.nullcontext)] + [
            (f"pieces={p}", lambda p=int(p): override("gated_delta_rule", "state_pieces", value=p))
            for p in args.pieces.split(",") if p]
        for label, ctx in variants:
            with ctx():
                fwd()
                torch.cuda.synchronize()
                sync_error = None
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fwd()
                except RuntimeError as exc:
                    sync_error = str(exc).splitlines()[0][:200]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                record(dict(B=B, T=T, H=H, HV=HV, variant=label, sync_error=sync_error, do_bench_ms=round(ms, 4),
                            queued_ms=round(queued_ms(fwd), 4), flushed_queued_ms=round(queued_ms(fwd, flush), 4)))


if __name__ == "__main__":
    main()
