"""Stop 60's probe (CUDA only): why the (1,131072,16,32) forward reads 0.1-0.34 ms slower under do_bench than the
sum of its kernels in a profile (H200, stop 57: 2.156 against 1.82 ms; H100, stop 60: 2.04-2.20 against 1.94),
while (1,32768,32,32) reads within a few us of its sum on the H100.

The profile (benchmarks/tuner_timing_check.kernel_times) runs the calls back to back; do_bench zeroes a 256 MB
buffer before each call. So per case and implementation (gdngen, and FlashQLA if it imports), in one process:
- `do_bench`: triton.testing.do_bench's quantiles 0.1 / 0.5 / 0.9 (warm-up 30 ms, 300 ms of calls);
- `events_flush` / `events_noflush`: 40 calls timed by CUDA events, each after the 256 MB zeroing or not, and
  the host's time in each call;
- `kernels_flush` / `kernels_noflush`: each kernel's device time per call (torch.profiler, 10 calls), the
  zeroing between calls or not (its own kernel left out).
Every row carries the host clock, so the SM clock / power log that the caller samples alongside (nvidia-smi,
read only) lines up with it.

Readings: a gap that is in events_flush and not in events_noflush is the flush's dirty L2 and cold caches;
a gap in kernels_flush too is kernels running slower after it; a gap only between events and kernels is idle
time between launches (a host time per call near the device's says the call waits for the GPU somewhere:
`syncs` counts the synchronising torch calls of one call, torch.cuda.set_sync_debug_mode); slow calls that come
together with a falling SM clock are power or heat.

    python benchmarks/results/2026-12-05-stop60-forward-gap-probe.py [--cases "1,131072,16,32 1,32768,32,32"]
"""
import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import inputs, row_recorder  # noqa: E402
from benchmarks.tuner_timing_check import kernel_times  # noqa: E402


def event_times(call, flush, reps=40):
    """Milliseconds of each of ``reps`` calls between CUDA events, each after the zeroing or not, and the host's
    milliseconds in each call (near the device's when something in the call waits for the GPU)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    host = []
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        begun = time.perf_counter()
        call()
        host.append((time.perf_counter() - begun) * 1e3)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)], host


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,131072,16,32 1,32768,32,32")
    parser.add_argument("--impls", default="gdngen,flashqla")
    args = parser.parse_args()
    from generated import gated_delta_rule as module
    impls = {}
    if "gdngen" in args.impls:
        impls["gdngen"] = lambda x: module.chunk_gated_delta_rule(**x, output_final_state=True)
    if "flashqla" in args.impls:
        try:
            from flash_qla import chunk_gated_delta_rule as flash_qla
            impls["flashqla"] = lambda x: flash_qla(x["q"], x["k"], x["v"], x["g"], x["beta"])
        except Exception as exc:  # noqa: BLE001
            print(f"flashqla unavailable: {exc!r}"[:300])
    record = row_recorder("forward-gap.jsonl")

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for case in args.cases.split():
        B, T, H, HV = (int(n) for n in case.split(","))
        x = inputs(B, T, H, HV)
        for name, op in impls.items():
            def call(op=op):
                with torch.no_grad():
                    return op(x)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                call()
                torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]
            record(case=case, impl=name, what="syncs", count=len(syncs), first=syncs[:3])
            q10, q50, q90 = triton.testing.do_bench(call, warmup=30, rep=300, quantiles=[0.1, 0.5, 0.9])
            record(case=case, impl=name, what="do_bench", ms=[round(q10, 4), round(q50, 4), round(q90, 4)])
            for label, buffer in (("flush", flush), ("noflush", None)):
                ms, host = event_times(call, buffer)
                record(case=case, impl=name, what=f"events_{label}", ms_min=round(min(ms), 4),
                       ms_median=round(statistics.median(ms), 4), ms_max=round(max(ms), 4),
                       host_ms_median=round(statistics.median(host), 4), host_ms_max=round(max(host), 4),
                       ms_each=[round(m, 3) for m in ms])
            for label, buffer in (("flush", flush), ("noflush", None)):
                # the zeroing's own fill kernel left out
                kernels = {kernel[:48]: round(us, 1) for kernel, us in
                           kernel_times(call, reps=10, before=buffer.zero_ if buffer is not None else None).items()
                           if "fill" not in kernel.lower()}
                record(case=case, impl=name, what=f"kernels_{label}", sum_us=round(sum(kernels.values()), 1),
                       kernels_us=kernels)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
