"""Context parallelism across the ranks of a ``torch.distributed`` group (:func:`context_parallel`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from gdngen.parallel.local import (_TRANSFERS, _Call, _Layout, _Pass, _check_transfer, _host_offsets, _local_pass,
                                   _normalized)
from gdngen.parallel.pipeline import piece_plan, pipelined_call
from gdngen.runtime.segments import intermediate_bytes


#: Bytes of state tensors this process has put through collectives (the size of every all-gathered
#: buffer, and of every all-reduced tensor), by direction. Benchmarks reset and read it.
COMM_BYTES = {"forward": 0, "backward": 0}


def _all_gather(x: Tensor, group, world: int, direction: str) -> list:
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(out, x, group=group)
    COMM_BYTES[direction] += x.numel() * x.element_size() * world
    return out


def _all_reduce(x: Tensor, group, direction: str) -> Tensor:
    x = x.contiguous()
    torch.distributed.all_reduce(x, group=group)
    COMM_BYTES[direction] += x.numel() * x.element_size()
    return x


@dataclass
class _RankPlan:
    rank: int
    world: int
    layout: _Layout
    out_rows: list         # local sequences whose end state the next rank continues from
    owned: list            # (global sequence id, local row or None for an empty sequence)
    N: int                 # sequences in the whole batch (rows of the final state)


def _shard_starts(T: int, group, world: int, device) -> list:
    """Every rank's first token: the shards' lengths are all-gathered (a host sync; varlen only)."""
    lengths = _all_gather(torch.tensor([T], dtype=torch.int64, device=device), group, world, "forward")
    lengths = torch.cat(lengths).tolist()
    return [sum(lengths[:r]) for r in range(world + 1)]


def _global_offsets(call: _Call, group, world: int):
    """(the packed batch's global cu_seqlens or None, every rank's first token, sequences in the whole
    batch) of a call; varlen offsets are checked against the all-gathered shard lengths."""
    B, T = call.shape[:2]
    if call.named["cu_seqlens"] is None:
        return None, [r * T for r in range(world + 1)], B
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen inputs are packed as B=1, got q of shape {tuple(call.named['q'].shape)}")
    offsets = _host_offsets(call.named["cu_seqlens"])
    starts = _shard_starts(T, group, world, call.named["q"].device)
    if offsets[-1] != starts[-1]:
        raise ValueError(f"cu_seqlens: the global offsets end at {offsets[-1]}, but the {world} ranks' shards hold "
                         f"{starts[-1]} tokens; pass the global cu_seqlens of the packed batch on every rank")
    return offsets, starts, len(offsets) - 1


def _rank_plan(call: _Call, rank: int, world: int, group=None) -> _RankPlan:
    """The widened pass's plan: the rank's shard as one piece (:func:`piece_plan`); every rank hands on
    its last sequence's pair (all rows when dense), whether or not that sequence continues."""
    B, T = call.shape[:2]
    offsets, starts, N = _global_offsets(call, group, world)
    (piece,) = piece_plan(B, T, rank, world, 1, call.named["initial_state"] is not None, offsets, starts)
    out_rows = list(range(B)) if offsets is None else [piece.layout.count - 1]
    return _RankPlan(rank, world, piece.layout, out_rows, piece.owned, N)


def _owned_finals(local: _Pass, S_in_all: Optional[Tensor], plan: _RankPlan, initial_state) -> Optional[Tensor]:
    if not plan.owned:
        return None
    finals = local.finals(S_in_all)
    HV, K, V = finals.shape[1:]
    rows = []
    for n, row in plan.owned:
        if row is not None:
            rows.append(finals[row])
        elif initial_state is not None:
            rows.append(initial_state[n].to(torch.float32))
        else:
            rows.append(finals.new_zeros(HV, K, V))
    return torch.stack(rows, dim=0)


class _ContextParallel(torch.autograd.Function):
    """The sharded call as one autograd node, so every rank runs the backward exchange once.

    forward: local op pass (graph kept) -> all_gather (N, M) -> compose this rank's start state ->
    corrected outputs and owned final states -> all_reduce of the final states.
    backward: all_reduce of the final-state gradients -> dS_start of this rank's carried sequence
    (cheap: through the correction only) -> all_gather -> suffix scan ``T_j = G_j + M_j^T T_{j+1}``
    gives dN, dM of this rank's outgoing pair -> one backward pass through the op.
    """

    @staticmethod
    def forward(ctx, call, plan, group, transfer, names, needs_graph, *tensors):
        # local leaves: the op's own graph is kept (when a backward can come) for the backward exchange
        grad_mode = torch.enable_grad if needs_graph else torch.no_grad
        leaves = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
        local_call = call.with_args(**dict(zip(names, leaves)))
        B, T, H, HV, K, V = call.shape
        device = call.named["q"].device
        with grad_mode(), call.same_paths_as(plan.N):      # the 1-GPU call's paths, whatever this shard holds
            local = _local_pass(local_call, plan.layout, transfer)
            out_N = local.final_N[plan.out_rows]
            out_M = (local.final_M[plan.out_rows] if local.final_M is not None
                     else out_N.new_zeros(len(plan.out_rows), HV, K, K))
            pair = torch.cat([out_N, out_M], dim=-1)                   # [P, HV, K, V + K]

        gathered = _all_gather(pair.detach(), group, plan.world, "forward")
        gathered_N = [x[..., :V] for x in gathered]
        gathered_M = [x[..., V:] for x in gathered]
        start = torch.zeros_like(out_N, dtype=torch.float32)          # [P, HV, K, V]
        for j in range(plan.rank):                                    # S <- M_j S + N_j
            start = gathered_M[j] @ start + gathered_N[j]

        with grad_mode():
            start_leaf = start.detach().requires_grad_(needs_graph)
            if plan.layout.cu_seqlens is None:
                S_in_all = start_leaf if plan.rank > 0 else None
            else:
                carried = plan.layout.carry[0]
                S_in_all = (torch.cat([start_leaf, start_leaf.new_zeros(plan.layout.count - 1, HV, K, V)])
                            if carried else None)
            o = local.outputs(S_in_all)
            output_final_state = bool(call.named["output_final_state"])
            owned = (_owned_finals(local, S_in_all, plan, local_call.named["initial_state"])
                     if output_final_state else None)

        if output_final_state:
            final = torch.zeros(plan.N, HV, K, V, device=device, dtype=torch.float32)
            if owned is not None:
                final[[n for n, _ in plan.owned]] = owned.detach()
            final = _all_reduce(final, group, "forward")
        else:
            final = o.new_empty(0, dtype=torch.float32)

        if needs_graph:
            ctx.graph = (o, owned, pair, start_leaf, leaves)
            ctx.state = (plan, group, gathered_M, start, output_final_state)
        return o.detach(), final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal):
        o, owned, pair, start_leaf, leaves = ctx.graph
        plan, group, gathered_M, start, output_final_state = ctx.state
        outputs, grads = [o], [do]
        if output_final_state:
            dfinal = _all_reduce(dfinal.clone(), group, "backward")
        if owned is not None:
            outputs.append(owned)
            grads.append(dfinal[[n for n, _ in plan.owned]])

        # this rank's own dS_start: through the output correction and the owned final states only
        (G,) = torch.autograd.grad(outputs, [start_leaf], grads, retain_graph=True, allow_unused=True)
        G = torch.zeros_like(start) if G is None else G
        gathered_G = _all_gather(G, group, plan.world, "backward")
        carried = torch.zeros_like(start)                             # T_{r+1}: dLoss/dS_start of rank r+1
        for j in range(plan.world - 1, plan.rank, -1):
            carried = gathered_G[j] + gathered_M[j].transpose(-1, -2) @ carried
        d_pair = torch.cat([carried, carried @ start.transpose(-1, -2)], dim=-1)    # [dN | dM = T S_start^T]

        wanted = [i for i, leaf in enumerate(leaves) if leaf is not None and leaf.requires_grad]
        found = torch.autograd.grad(outputs + [pair], [leaves[i] for i in wanted], grads + [d_pair],
                                    allow_unused=True)
        result = [None] * len(leaves)
        for i, gr in zip(wanted, found):
            result[i] = torch.zeros_like(leaves[i]) if gr is None else gr
        del ctx.graph
        return (None, None, None, None, None, None, *result)


#: Bytes of backward intermediates one op call of the pipeline may hold (its calls run the backward
#: whole, not in the op's 256 MiB time segments: many small calls would leave the GPU waiting on
#: the host's launches, see benchmarks/NOTES.md stop 24)
PIPELINE_CALL_BYTES = 16 << 30


def _backward_split(call: _Call):
    """``length -> calls``: how many consecutive op calls a piece of ``length`` tokens runs as, so
    that each call's backward intermediates stay under :data:`PIPELINE_CALL_BYTES`."""
    B, T, H, HV, K, V = call.shape
    delta = bool((call.info or {}).get("delta", True))
    itemsize = call.named["q"].element_size()
    return lambda length: -(-intermediate_bytes(B=B, T=length, HV=HV, K=K, V=V, BT=call.chunk_size,
                                                itemsize=itemsize, delta=delta) // PIPELINE_CALL_BYTES)


def resolve_transfer(call: _Call, transfer: str, world: int, pieces: int = 1) -> str:
    """The scheme a ``transfer`` choice runs on ``world`` ranks: 'closed_form', 'op' or 'pipeline'.

    'auto': pipelined passes for striped shards (``pieces > 1``); otherwise the closed form where
    the spec has one (the additive family), pipelined passes on two ranks (the widened pass costs
    about twice the plain one there: measured in ``benchmarks/bench_cp.py``) and the widened op
    pass on more (contiguous shards' state passes run one rank after another, so their share of
    the time does not shrink with the ranks).
    """
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
        raise ValueError(f"pieces: expected a positive int, got {pieces!r}")
    if pieces > 1 and transfer not in ("auto", "pipeline"):
        raise ValueError(f"pieces: striped shards ({pieces} pieces per rank) run with transfer='pipeline' "
                         f"(or 'auto'), not {transfer!r}")
    if transfer != "auto":
        return transfer
    if pieces > 1:
        return "pipeline"
    if call.closed_form_decay() is not None:
        return "closed_form"
    return "pipeline" if world == 2 else "op"


def _default_group(group):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; call torch.distributed.init_process_group "
                         "(torchrun sets the environment) before context_parallel")
    return group if group is not None else dist.group.WORLD


def context_parallel(fn: Callable, *args, group=None, transfer: str = "auto", pieces: int = 1, **kwargs):
    """Run a chunk op on one shard of the token dimension per rank of ``group``, exactly.

    Call it on every rank of ``group`` with the same arguments as ``fn`` (a generated
    ``chunk_<name>``, e.g. ``generated.gated_delta_rule.chunk_gated_delta_rule``), except that the
    per-token tensors (q, k, v, g, beta) hold this rank's contiguous slice of the sequence dim,
    in rank order (see :func:`shard_tokens`; shards may differ in length, e.g. :func:`shard_sizes`
    gives rank 0, which runs the plain op, a larger share). With ``pieces = n > 1`` the shards are
    striped instead: the sequence is cut into ``n * world`` equal pieces and this rank's tensors
    hold pieces ``rank, rank + world, ...`` concatenated (``shard_tokens(x, pieces=n)``; outputs
    come back in the same layout). That keeps every rank busy while another runs its state pass:
    the fastest layout for the delta family (:mod:`gdngen.parallel.pipeline`). Every rank must pass the same
    ``initial_state`` (the whole batch's), options and, for varlen, the global ``cu_seqlens`` of the
    packed batch (B = 1; the shards' lengths are all-gathered to place them). Sequences may cross
    any number of shard boundaries; only the sequence crossing a boundary carries state across it.

    Returns ``(o, final_state)``: ``o`` is this rank's shard of the outputs; ``final_state`` (with
    ``output_final_state=True``) is the whole batch's ``[N, HV, K, V]`` float32 final states,
    identical on every rank. Both equal the single-process call's up to float rounding.

    Backward is exact too: each rank runs one backward pass of the op and the ranks exchange state
    gradients. Gradients of the per-token tensors are this rank's shard; gradients of arguments every
    rank passes whole (``initial_state``, ``A_log``, ``dt_bias``) are this rank's contribution: sum
    them over the group (as data-parallel gradient reduction does). The final state may be used by
    the loss on any subset of ranks (its gradient is summed over the group). Every rank must
    backpropagate through the call (it holds collectives), or none.

    ``transfer``: 'auto' (default) uses the closed-form transition for the additive family, and
    otherwise pipelined passes on two ranks and the op's widened pass on more (:func:`resolve_transfer`);
    'op' always uses the widened pass; 'closed_form' insists on the closed form; 'pipeline' runs
    every rank's op at its normal width, each state pass waiting for the previous rank's end state
    (and each reverse state pass for the next rank's start-state gradient), everything else in
    the op overlapping them (:mod:`gdngen.parallel.pipeline`).
    Communication per call: widened and closed form, one all_gather of ``[P, HV, K, V + K]``
    float32 (P = B, or 1 for varlen; varlen adds one of the shard lengths) and, with
    ``output_final_state``, one all_reduce of the final states; in backward one all_gather of
    ``[P, HV, K, V]`` and the all_reduce again. Pipeline: ``[P, HV, K, V]`` float32 sent once across
    each boundary a sequence crosses, each way, plus the same all_reduces.
    """
    call = _Call.bind(fn, args, kwargs)
    _check_transfer(call, transfer, _TRANSFERS + ("pipeline",))
    group = _default_group(group)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    scheme = resolve_transfer(call, transfer, world, pieces)
    if world == 1:
        return call.run()
    call, finish = _normalized(call)
    names = [n for n, x in call.named.items() if isinstance(x, Tensor) and n != "cu_seqlens"]
    tensors = [call.named[n] for n in names]
    needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if scheme == "pipeline":
        B, T = call.shape[:2]
        offsets, starts, N = _global_offsets(call, group, world)
        plan = piece_plan(B, T, rank, world, pieces, call.named["initial_state"] is not None, offsets, starts,
                          split=_backward_split(call) if needs_graph else None, multiple=call.chunk_size)
        o, final = pipelined_call(call, plan, N, group, names, tensors, needs_graph, COMM_BYTES,
                                  lambda x, direction: _all_reduce(x, group, direction))
    else:
        plan = _rank_plan(call, rank, world, group)
        o, final = _ContextParallel.apply(call, plan, group, transfer, names, needs_graph, *tensors)
    final = final if call.named["output_final_state"] else None
    return finish(o, final) if finish else (o, final)


def shard_sizes(T: int, world: int, *, first_weight: float = 1.0, multiple: int = 64) -> list:
    """Token counts of ``world`` contiguous shards of a ``T``-token sequence.

    Rank 0 holds no carried state, so it runs the plain op while every other rank runs the widened
    transfer pass (delta family: values ``V + K`` wide). ``first_weight`` > 1 gives rank 0 that many
    times the tokens of each other rank to even out their times (the ratio of the widened pass's cost
    to the plain one's: ``benchmarks/bench_cp.py`` measures it; about 1 for the additive family).
    Sizes are multiples of ``multiple`` (the chunk size) except the last, when ``T`` allows.
    """
    if world < 1 or T < 0:
        raise ValueError(f"world, T: expected world >= 1 and T >= 0, got world={world}, T={T}")
    if not first_weight > 0:
        raise ValueError(f"first_weight: expected a positive number, got {first_weight!r}")
    if T < world * multiple:
        multiple = 1                          # too short for whole chunks on every rank
    weights = [float(first_weight)] + [1.0] * (world - 1)
    sizes, taken = [], 0
    for r in range(world - 1):
        share = T * weights[r] / sum(weights)
        size = min(T - taken, max(0, int(round(share / multiple)) * multiple))
        sizes.append(size)
        taken += size
    return sizes + [T - taken]


def shard_tokens(x: Optional[Tensor], group=None, dim: int = 1, sizes: Optional[list] = None,
                 pieces: int = 1) -> Optional[Tensor]:
    """This rank's share of ``x`` along ``dim`` (the token dim of ``[B, T, ...]`` tensors).

    A contiguous slice: equal slices by default, ``sizes`` (one count per rank, e.g. from
    :func:`shard_sizes`) otherwise. ``pieces = n > 1``: striped, for ``context_parallel(...,
    pieces=n)`` - ``x`` is cut into ``n * world`` equal pieces and this rank gets pieces ``rank,
    rank + world, ...`` concatenated (a copy). The same call on a full-length output gives the
    part of it this rank's outputs hold.
    """
    if x is None:
        return None
    group = _default_group(group)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
        raise ValueError(f"pieces: expected a positive int, got {pieces!r}")
    if pieces > 1:
        if sizes is not None:
            raise ValueError("sizes, pieces: striped shards are equal; pass one of them")
        if x.shape[dim] % (world * pieces):
            raise ValueError(f"x: dim {dim} of shape {tuple(x.shape)} does not split into {world * pieces} "
                             f"equal pieces ({pieces} per rank)")
        return torch.cat(x.chunk(world * pieces, dim=dim)[rank::world], dim=dim)
    if sizes is None:
        if x.shape[dim] % world:
            raise ValueError(f"x: dim {dim} of shape {tuple(x.shape)} does not split into {world} equal shards")
        return x.chunk(world, dim=dim)[rank]
    if len(sizes) != world or sum(sizes) != x.shape[dim]:
        raise ValueError(f"sizes: expected {world} counts summing to {x.shape[dim]} (dim {dim} of x), got {sizes}")
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])
