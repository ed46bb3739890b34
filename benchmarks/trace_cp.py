"""Where a context-parallel call's time goes: one profiled call per rank, kernels per stream.

    torchrun --nproc_per_node=2 benchmarks/trace_cp.py --pieces 4 [--backward]

Each rank warms up, then (``--cprofile``) profiles its host over 5 calls, then records one call
under torch.profiler and writes
``$OUT/cp_trace_rank<r>.jsonl``: one row per GPU kernel or memcpy (name, stream, start and end in
microseconds from the call's first kernel), and the host time the call took to return. Read them
with ``python benchmarks/trace_cp.py --summarise DIR``: per rank, the busy and idle time of the
compute stream and the gaps before each state pass.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402


def record(args):
    import torch.distributed as dist
    from benchmarks.bench_cp import chunk_op, make_inputs, piece_of
    from gdngen.parallel import context_parallel
    import benchmarks.bench_cp as bench
    bench.DEVICE, bench.DTYPE = "cuda", torch.bfloat16
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    fn = chunk_op(args.spec)
    x = make_inputs(1, args.tokens, args.heads, args.value_heads, "cuda", requires_grad=args.backward)
    leaves = {n: (piece_of(t.detach(), rank, world, None, args.pieces) if n in ("q", "k", "v", "g", "beta")
                  else t.detach()).clone().requires_grad_(args.backward) for n, t in x.items()}

    def call():
        o, h = context_parallel(fn, **leaves, output_final_state=True, pieces=args.pieces)
        if args.backward:
            (o.float().sum() + h.sum()).backward()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    if args.cprofile:
        import cProfile
        import io
        import pstats
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            call()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
        pstats.Stats(profile, stream=text).sort_stats("cumtime").print_stats(40)
        out = os.environ.get("OUT", "trace_out")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"cp_host_rank{rank}.txt"), "w") as f:
            f.write(text.getvalue())
        dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        call()
        host_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        total_ms = (time.perf_counter() - start) * 1e3
    rows = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append(dict(name=e.name[:80], stream=getattr(e, "device_resource_id", None),
                             start=e.time_range.start, end=e.time_range.end))
    t0 = min(r["start"] for r in rows)
    for r in rows:
        r["start"] -= t0
        r["end"] -= t0
    rows.sort(key=lambda r: r["start"])
    out = os.environ.get("OUT", "trace_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"cp_trace_rank{rank}.jsonl"), "w") as f:
        f.write(json.dumps(dict(rank=rank, pieces=args.pieces, backward=args.backward, host_ms=host_ms,
                                total_ms=total_ms)) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def summarise(folder):
    for path in sorted(glob.glob(os.path.join(folder, "cp_trace_rank*.jsonl"))):
        lines = [json.loads(line) for line in open(path)]
        head, rows = lines[0], lines[1:]
        print(f"== {os.path.basename(path)}: {head}")
        streams = {}
        for r in rows:
            streams.setdefault(r["stream"], []).append(r)
        for stream, items in streams.items():
            busy = sum(r["end"] - r["start"] for r in items)
            span = max(r["end"] for r in items) - min(r["start"] for r in items)
            print(f"stream {stream}: {len(items)} kernels, busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms")
            prev_end = None
            for r in items:
                gap = (r["start"] - prev_end) if prev_end is not None else 0.0
                print(f"   {r['start'] / 1e3:8.3f} {r['end'] / 1e3:8.3f} ({(r['end'] - r['start']) / 1e3:6.3f}) "
                      f"gap {gap / 1e3:6.3f}  {r['name']}")
                prev_end = r["end"] if prev_end is None else max(prev_end, r["end"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--tokens", type=int, default=262144)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=32)
    parser.add_argument("--pieces", type=int, default=4)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--cprofile", action="store_true",
                        help="also profile the host (cProfile over 5 calls): $OUT/cp_host_rank<r>.txt")
    parser.add_argument("--summarise", metavar="DIR")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
    else:
        record(args)


if __name__ == "__main__":
    main()
