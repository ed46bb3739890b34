"""Context-parallel benchmark: one long sequence on 1 vs 2 GPUs, and the intra-card split on one GPU.

Two modes, each one process tree that checks, times and prints a table last; every row is appended
to $OUT/cp.jsonl as soon as it is measured.

    # two H200s (the 2-GPU machine): one 262144-token sequence, H=16, HV=32, K=V=128, bf16
    torchrun --nproc_per_node=2 benchmarks/bench_cp.py --mode cp
    # one H200: the intra-card split at (1,131072,16,32) and (1,32768,2,8) against no split
    python benchmarks/bench_cp.py --mode split

cp: every rank times the plain op on the whole sequence (the 1-GPU baseline, each on its own GPU),
the op on an equal shard alone (the no-communication floor), then ``context_parallel`` with each of
``--transfers`` (auto: pipelined passes on two ranks for the delta rule; op: the widened transfer
pass) and rank 0's share of the tokens weighted by each of ``--first-weights``, and for the
pipeline striped shards of each of ``--pieces`` pieces per rank (the slowest rank's time counts). Forward at the full length; forward+backward at ``--bwd-tokens`` with each of
``--bwd-first-weights``.
Rows carry the bytes put through collectives per call and the error against the 1-GPU result.

split: forward of ``split_sequence_forward`` at segments 1 (plain op), 2, 4, 8, 16 and 'auto' (the
tuner's cached count, ``gdngen tune ... --stages split``, else 1; recorded as ``auto=N``), each
checked against the plain op.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")       # no NVLink multicast on the shared hosts

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gdngen import parallel
from gdngen.parallel import choose_segments, context_parallel, shard_sizes, split_sequence_forward
from gdngen.selfcheck import rel_rmse

OUT = os.environ.get("OUT", "bench_out")
ROWS = os.path.join(OUT, "cp.jsonl")
K = V = 128
DEVICE = "cuda"                 # --device cpu: a dry run of the whole script (gloo, float32, interpreter)
DTYPE = torch.bfloat16


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(row: dict, rank: int = 0) -> None:
    if rank != 0:
        return
    os.makedirs(OUT, exist_ok=True)
    with open(ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def chunk_op(spec: str):
    module = __import__(f"generated.{spec}", fromlist=["x"])
    return getattr(module, f"chunk_{spec}")


def make_inputs(B, T, H, HV, device, seed=0, requires_grad=False):
    """GDN-style inputs, the same on every rank (one seeded generator)."""
    dtype = DTYPE
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, K, device=device, generator=gen).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device=device, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, device=device, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, device=device, generator=gen))
    h0 = torch.randn(B, HV, K, V, device=device, generator=gen) * 0.1
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    if requires_grad:
        x = {n: t.requires_grad_() for n, t in x.items()}
    return x


def timed(fn, reps: int, warmup: int = 1, distributed: bool = False) -> float:
    """Median wall time (ms) over ``reps`` calls, synchronised; the slowest rank's when distributed."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if distributed:
            dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], device=DEVICE)
        if distributed:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times) * 1e3


def piece_of(t, rank: int, world: int, sizes=None, pieces: int = 1):
    """This rank's part of a [B, T, ...] tensor: a contiguous slice (``sizes``) or striped pieces."""
    if pieces > 1:
        return torch.cat(t.chunk(world * pieces, dim=1)[rank::world], dim=1)
    sizes = sizes or [t.shape[1] // world] * world
    start = sum(sizes[:rank])
    return t[:, start:start + sizes[rank]]


def shard(x: dict, rank: int, world: int, sizes=None, pieces: int = 1) -> dict:
    return {n: (piece_of(t, rank, world, sizes, pieces) if n in ("q", "k", "v", "g", "beta") else t)
            for n, t in x.items()}


def layouts(args, weights: list):
    """(transfer, first weight, pieces) of every CP row: weights for contiguous shards, pieces for striped."""
    rows = []
    for transfer in args.transfers:
        rows += [(transfer, w, 1) for w in weights]
        if transfer in ("auto", "pipeline"):
            rows += [(transfer, 1.0, n) for n in args.pieces if n > 1]
    return rows


def mode_cp(args) -> list:
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))     # before NCCL binds a device
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fn = chunk_op(args.spec)
    B, T, H, HV = 1, args.tokens, args.heads, args.value_heads
    base = dict(spec=args.spec, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=str(DTYPE)[6:], world=world)
    table = []

    # ---- forward at the full length: the plain op on the whole sequence (1 GPU), the plain op on
    # an equal shard alone (no communication, no transfer), then CP with rank 0's share weighted by
    # each --first-weights value (rank 0 runs the plain op, the others the widened transfer pass)
    x = make_inputs(B, T, H, HV, DEVICE)
    with torch.no_grad():
        start = time.perf_counter()
        o_ref, h_ref = fn(**x, output_final_state=True)
        sync()
        first_s = time.perf_counter() - start
        one = timed(lambda: fn(**x, output_final_state=True), args.reps)
        rows = [("1 GPU", one, 1, {"first_call_s": first_s})]
        local = shard(x, rank, world)
        rows.append((f"own 1/{world} alone", timed(lambda: fn(**local, output_final_state=True), args.reps), 1, {}))
        for transfer, weight, pieces in layouts(args, args.first_weights):
            sizes = shard_sizes(T, world, first_weight=weight) if pieces == 1 else None
            local = shard(x, rank, world, sizes, pieces)
            start = time.perf_counter()
            o_cp, h_cp = context_parallel(fn, **local, output_final_state=True, transfer=transfer, pieces=pieces)
            sync()
            first_s = time.perf_counter() - start
            err = torch.tensor([rel_rmse(o_cp, piece_of(o_ref, rank, world, sizes, pieces)), rel_rmse(h_cp, h_ref)],
                               device=DEVICE)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            del o_cp, h_cp
            parallel.COMM_BYTES.update(forward=0, backward=0)
            context_parallel(fn, **local, output_final_state=True, transfer=transfer, pieces=pieces)
            comm = torch.tensor([parallel.COMM_BYTES["forward"]], device=DEVICE, dtype=torch.float64)
            dist.all_reduce(comm)                   # every rank's sends (P2P: only the sender counts)
            extra = dict(comm_bytes=int(comm.item()), shard_sizes=sizes, first_weight=weight, transfer=transfer,
                         pieces=pieces, err_o=err[0].item(), err_final=err[1].item(), first_call_s=first_s)
            cp = timed(lambda: context_parallel(fn, **local, output_final_state=True, transfer=transfer,
                                                pieces=pieces), args.reps, distributed=True)
            label = f"w={weight:g}" if pieces == 1 else f"pieces={pieces}"
            rows.append((f"CP {world} {transfer} {label}", cp, world, extra))
    for label, ms, gpus, extra in rows:
        row = dict(base, mode="cp", pass_="fwd", impl=label, gpus=gpus, ms=ms, tokens_per_s=B * T / (ms * 1e-3),
                   speedup=one / ms, **extra)
        log(row, rank)
        table.append(row)
    del x, local, o_ref, h_ref
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

    # ---- forward + backward at --bwd-tokens
    if args.bwd_tokens > 0:
        Tb = args.bwd_tokens
        try:
            x = make_inputs(B, Tb, H, HV, DEVICE, requires_grad=True)
            gen = torch.Generator(device=DEVICE).manual_seed(1)
            w = torch.randn(B, Tb, HV, V, device=DEVICE, generator=gen).to(DTYPE)

            def single():
                for t in x.values():
                    t.grad = None
                o, h = fn(**x, output_final_state=True)
                ((o * w).float().sum() + h.sum()).backward()

            single()
            one = timed(single, args.bwd_reps, warmup=0)
            row = dict(base, T=Tb, mode="cp", pass_="fwd+bwd", impl="1 GPU", gpus=1, ms=one,
                       tokens_per_s=B * Tb / (one * 1e-3), speedup=1.0, comm_bytes=0)
            log(row, rank)
            table.append(row)
            for transfer, weight, pieces in layouts(args, args.bwd_first_weights):
                sizes = shard_sizes(Tb, world, first_weight=weight) if pieces == 1 else None
                leaves = {n: piece_of(t.detach(), rank, world, sizes, pieces).clone().requires_grad_()
                          if n in ("q", "k", "v", "g", "beta") else t.detach().clone().requires_grad_()
                          for n, t in x.items()}
                w_local = piece_of(w, rank, world, sizes, pieces)

                def sharded():
                    for t in leaves.values():
                        t.grad = None
                    o, h = context_parallel(fn, **leaves, output_final_state=True, transfer=transfer, pieces=pieces)
                    loss = (o * w_local).float().sum()
                    if rank == 0:
                        loss = loss + h.sum()
                    loss.backward()

                sharded()
                grad_err = 0.0
                for n, t in x.items():
                    mine = leaves[n].grad
                    if n == "initial_state":
                        mine = mine.clone()
                        dist.all_reduce(mine)
                        ref = t.grad
                    else:
                        ref = piece_of(t.grad, rank, world, sizes, pieces)
                    grad_err = max(grad_err, rel_rmse(mine, ref))
                err = torch.tensor([grad_err], device=DEVICE)
                dist.all_reduce(err, op=dist.ReduceOp.MAX)
                parallel.COMM_BYTES.update(forward=0, backward=0)
                sharded()
                comm = torch.tensor([parallel.COMM_BYTES["forward"] + parallel.COMM_BYTES["backward"]],
                                    device=DEVICE, dtype=torch.float64)
                dist.all_reduce(comm)
                cp = timed(sharded, args.bwd_reps, warmup=0, distributed=True)
                label = f"w={weight:g}" if pieces == 1 else f"pieces={pieces}"
                row = dict(base, T=Tb, mode="cp", pass_="fwd+bwd", impl=f"CP {world} {transfer} {label}",
                           gpus=world, ms=cp, tokens_per_s=B * Tb / (cp * 1e-3), speedup=one / cp,
                           comm_bytes=int(comm.item()), err_grads=err.item(), transfer=transfer,
                           shard_sizes=sizes, first_weight=weight, pieces=pieces)
                log(row, rank)
                table.append(row)
        except torch.cuda.OutOfMemoryError as exc:
            log(dict(base, T=Tb, mode="cp", pass_="fwd+bwd", error=f"out of memory: {exc}"[:300]), rank)
    dist.barrier()
    dist.destroy_process_group()
    return table if rank == 0 else []


def mode_split(args) -> list:
    fn = chunk_op(args.spec)
    table = []
    for B, T, H, HV in args.split_shapes:
        x = make_inputs(B, T, H, HV, DEVICE)
        auto = choose_segments(fn, **x)                 # what segments='auto' runs (tuned, else 1)
        with torch.no_grad():
            o_ref, h_ref = fn(**x, output_final_state=True)
            plain = None
            for segments in (1, 2, 4, 8, 16, "auto"):
                start = time.perf_counter()
                o, h = split_sequence_forward(fn, **x, output_final_state=True, segments=segments)
                sync()
                first_s = time.perf_counter() - start
                ms = timed(lambda: split_sequence_forward(fn, **x, output_final_state=True, segments=segments),
                           args.reps)
                plain = ms if segments == 1 else plain
                row = dict(spec=args.spec, mode="split", pass_="fwd", B=B, T=T, H=H, HV=HV, K=K, V=V,
                           dtype=str(DTYPE)[6:], segments=segments if segments != "auto" else f"auto={auto}",
                           ms=ms, tokens_per_s=B * T / (ms * 1e-3), speedup=plain / ms, first_call_s=first_s,
                           err_o=rel_rmse(o, o_ref), err_final=rel_rmse(h, h_ref))
                log(row)
                table.append(row)
        del x, o_ref, h_ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return table


def print_table(rows: list) -> None:
    if not rows:
        return
    print()
    print(f"{'mode':6} {'pass':8} {'shape':24} {'impl / segments':26} {'ms':>9} {'Mtok/s':>8} {'x':>6} "
          f"{'comm MB':>8} {'err o':>9} {'err h/grad':>10}")
    for r in rows:
        shape = f"({r['B']},{r['T']},{r['H']},{r['HV']})"
        what = r.get("impl", r.get("segments"))
        err_other = r.get("err_final", r.get("err_grads", float("nan")))
        print(f"{r['mode']:6} {r['pass_']:8} {shape:24} {str(what):26} {r['ms']:9.2f} {r['tokens_per_s'] / 1e6:8.2f} "
              f"{r['speedup']:6.2f} {r.get('comm_bytes', 0) / 1e6:8.2f} {r.get('err_o', float('nan')):9.2e} "
              f"{err_other:10.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cp", "split"], required=True)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--tokens", type=int, default=262144, help="cp: the whole sequence's length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=32)
    parser.add_argument("--bwd-tokens", type=int, default=None,
                        help="cp: sequence length of the forward+backward rows (default: --tokens, the issue's "
                             "262144; 0: skip them)")
    parser.add_argument("--transfers", default="auto",
                        help="cp: context_parallel transfer schemes, comma-separated (auto, pipeline, op)")
    parser.add_argument("--first-weights", default="0.75,1",
                        help="cp: rank 0's share of the tokens relative to each other rank's, one CP row each")
    parser.add_argument("--bwd-first-weights", default="0.75,1",
                        help="cp: the same for the forward+backward rows")
    parser.add_argument("--pieces", default="4,8",
                        help="cp: striped layouts (pieces per rank) timed with the pipelined transfer")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per row (default 10; --device cpu: 1)")
    parser.add_argument("--bwd-reps", type=int, default=5)
    parser.add_argument("--split-shapes", default=None,
                        help="split: B,T,H,HV cases separated by ';' (default 1,131072,16,32;1,32768,2,8; "
                             "--device cpu: 1,512,2,8)")
    parser.add_argument("--head-dim", type=int, default=None, help="K = V (default 128; --device cpu: 16)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run with tiny shapes under TRITON_INTERPRET=1 (gloo, float32)")
    args = parser.parse_args()
    dry = args.device == "cpu"
    if args.reps is None:
        args.reps = 1 if dry else 10
    if args.split_shapes is None:
        args.split_shapes = "1,512,2,8" if dry else "1,131072,16,32;1,32768,2,8"
    if args.head_dim is None:
        args.head_dim = 16 if dry else 128
    if args.bwd_tokens is None:
        args.bwd_tokens = args.tokens
    args.split_shapes = [tuple(int(n) for n in case.split(",")) for case in args.split_shapes.split(";")]
    args.first_weights = [float(w) for w in args.first_weights.split(",")]
    args.bwd_first_weights = [float(w) for w in args.bwd_first_weights.split(",")]
    args.transfers = args.transfers.split(",")
    args.pieces = [int(n) for n in args.pieces.split(",")]
    global DEVICE, DTYPE, K, V
    DEVICE, K, V = args.device, args.head_dim, args.head_dim
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32     # the interpreter mishandles bf16 dots
    table = mode_cp(args) if args.mode == "cp" else mode_split(args)
    print_table(table)


if __name__ == "__main__":
    main()
