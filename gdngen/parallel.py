"""Context parallelism for the generated chunk ops: one long sequence split into pieces that run
side by side -- across the ranks of a ``torch.distributed`` group (:func:`context_parallel`) or
across the SMs of one GPU (:func:`split_sequence_forward`). Exact: no decayed history is dropped.

Why it works (DESIGN.md section 1): every spec's recurrence is affine in the state, so a piece of a
sequence maps its start state to its end state as ``S_end = M S_start + N`` (``M`` is ``[K, K]``
per value head, ``N`` is ``[K, V]``), and its outputs are affine in the start state too,
``o_t = o_t(0) + S_start^T p_t`` with ``p_t = M_t^T (scale q_t)`` (``M_t`` the transition up to
token ``t``). One call of the generated op yields all of it: append ``K`` zero columns to ``v`` and
start those columns from the identity. The op then returns ``[o(0) | p]`` as its output and
``[N | M]`` as its final state (zero values write nothing, so only the transition acts on the
identity). For the additive family (no delta rule) ``M`` and ``p`` have closed forms that the
wrapper computes from the gates instead (``I``, ``exp(sum g) I`` or ``diag(exp(sum g))``), so the
op runs at its normal width.

The pieces exchange only their ``(M, N)`` pairs (state-sized), compose them to get their true
start states, and add ``S_start^T p_t`` to their outputs -- no second pass. Backward is the same
structure reversed: one backward pass of the op per piece plus an exchange of state gradients
(``dS_start`` of later pieces flows back to earlier ones through ``M^T``).

Varlen (packed sequences, ``cu_seqlens``): a piece boundary may fall inside a sequence; only that
sequence carries state across it, and every sequence that starts inside a piece starts from its own
initial state.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["context_parallel", "split_sequence_forward", "choose_segments", "shard_tokens", "shard_sizes",
           "COMM_BYTES"]

#: Bytes of state tensors this process has put through collectives (the size of every all-gathered
#: buffer, and of every all-reduced tensor), by direction. Benchmarks reset and read it.
COMM_BYTES = {"forward": 0, "backward": 0}

_PER_TOKEN = ("q", "k", "v", "g", "beta")      # arguments laid out [B, T, ...]
_REQUIRED = ("q", "k", "v", "initial_state", "output_final_state", "cu_seqlens")
_TRANSFERS = ("auto", "op", "closed_form")
_LOG_DECAY_FLOOR = -60.0   # the generated gates stage floors each token's log-decay here


# =============================================================================================
# The call being parallelised
# =============================================================================================

@dataclass
class _Call:
    """A chunk function and its arguments, bound by name to the function's signature."""

    fn: Callable
    named: dict
    info: Optional[dict]          # the generated module's SPEC_INFO (None for a foreign function)

    @classmethod
    def bind(cls, fn: Callable, args: tuple, kwargs: dict) -> "_Call":
        if not callable(fn):
            raise TypeError(f"fn: expected a chunk function such as generated.gated_delta_rule."
                            f"chunk_gated_delta_rule, got {type(fn).__name__}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"fn: cannot read the signature of {fn!r}") from exc
        missing = [name for name in _REQUIRED if name not in signature.parameters]
        if missing:
            raise TypeError(f"fn: {getattr(fn, '__name__', fn)!r} lacks the chunk-op arguments {missing} "
                            "(expected an FLA-style chunk_* function)")
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"arguments of {getattr(fn, '__name__', fn)}: {exc}") from None
        bound.apply_defaults()
        named = dict(bound.arguments)
        for name in ("q", "k", "v"):
            x = named[name]
            if not isinstance(x, Tensor) or x.dim() != 4:
                raise (TypeError if not isinstance(x, Tensor) else ValueError)(
                    f"{name}: expected a 4-D tensor [B, T, heads, dim], got "
                    f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        info = getattr(module, "SPEC_INFO", None)
        return cls(fn=fn, named=named, info=info if isinstance(info, dict) else None)

    def with_args(self, **changes) -> "_Call":
        return _Call(self.fn, {**self.named, **changes}, self.info)

    def run(self, **changes):
        return self.fn(**{**self.named, **changes})

    @property
    def shape(self):
        B, T, H, K = self.named["q"].shape
        HV, V = self.named["v"].shape[2], self.named["v"].shape[3]
        return B, T, H, HV, K, V

    @property
    def chunk_size(self) -> int:
        size = self.named.get("chunk_size")
        return size if isinstance(size, int) and size > 0 else 64

    def same_paths_as(self, sequences: int):
        """A context in which the op takes the kernel paths a call over ``sequences`` sequences takes.

        The op picks some paths by its batch size (the delta rule's W/U-in-memory vs T, N * HV < 32:
        :func:`gdngen.runtime.tiles.store_wu`) and the two round bf16 differently (2.66e-3 apart at
        (1,32768,2,8) on the H200, each ~3.4e-3 from float64). A split or sharded call runs other
        batch sizes than the call it stands for; pinned, it matches that call to the rounding at
        the piece boundaries (1e-4), and the segment count (the tuner's choice) changes no numerics.
        """
        name = (self.info or {}).get("name")
        if not name:
            return contextlib.nullcontext()
        from gdngen.runtime.tiles import decide_as_for
        return decide_as_for(name, N=sequences)

    def closed_form_decay(self) -> Optional[str]:
        """'none' | 'scalar' | 'vector' when the transfer has a closed form for this call, else None.

        The additive family's transition is the decay alone; the closed form needs the activated
        log-decay, so fused gates or in-op q/k normalisation send the call through the op instead.
        """
        info = self.info
        if info is None or info.get("delta", True):
            return None
        if self.named.get("use_gate_in_kernel") or self.named.get("use_qk_l2norm_in_kernel"):
            return None
        decay = info.get("decay")
        return decay if decay in ("none", "scalar", "vector") else None


def _check_transfer(call: _Call, transfer: str) -> None:
    if transfer not in _TRANSFERS:
        raise ValueError(f"transfer: expected one of {list(_TRANSFERS)}, got {transfer!r}")
    if transfer == "closed_form" and call.closed_form_decay() is None:
        raise ValueError("transfer: 'closed_form' needs an additive spec (no delta rule) called without "
                         "use_gate_in_kernel / use_qk_l2norm_in_kernel; use 'auto' or 'op'")


# =============================================================================================
# One pass of the op over a set of local sequences
# =============================================================================================

@dataclass
class _Layout:
    """The sequences of one op call.

    ``cu_seqlens`` None: dense rows, sequence ``b`` is row ``b`` of the ``[B, T]`` inputs.
    Otherwise packed (B = 1): sequence ``i`` spans tokens ``spans[i]``. ``carry[i]``: the sequence
    continues from a state only known after the exchange (its start state is ``S_in[i]``);
    ``init_rows[i]``: the row of the user's ``initial_state`` it starts from, or -1 (zeros, or a
    carried state).
    """

    cu_seqlens: Optional[list]
    spans: list
    carry: list
    init_rows: list

    @property
    def count(self) -> int:
        return len(self.carry)


@dataclass
class _Pass:
    """What one op call over a layout yields, before the start states are known."""

    o_fresh: Tensor                      # [B, T, HV, V] outputs as if every carried state were 0
    final_N: Tensor                      # [L, HV, K, V] float32 end states from those starts
    final_M: Optional[Tensor]            # [L, HV, K, K] float32 transitions (0 for fresh rows); None: all 0
    layout: _Layout
    correction: Callable = field(repr=False)   # (o_fresh, S_in [L, HV, K, V]) -> o

    def outputs(self, S_in: Optional[Tensor]) -> Tensor:
        if S_in is None or self.final_M is None:
            return self.o_fresh
        return self.correction(self.o_fresh, S_in)

    def finals(self, S_in: Optional[Tensor]) -> Tensor:
        """[L, HV, K, V] float32 true end state of every local sequence."""
        if S_in is None or self.final_M is None:
            return self.final_N
        return self.final_N + self.final_M @ S_in


def _fresh_initial_state(initial_state: Optional[Tensor], layout: _Layout, like: Tensor) -> Optional[Tensor]:
    """[L, HV, K, V] start states for the op: the user's rows for fresh sequences, 0 elsewhere."""
    rows = layout.init_rows
    if initial_state is None or all(r < 0 for r in rows):
        return None
    if rows == list(range(initial_state.shape[0])):
        return initial_state
    index = torch.tensor([max(r, 0) for r in rows], device=initial_state.device)
    keep = torch.tensor([r >= 0 for r in rows], device=initial_state.device).view(-1, 1, 1, 1)
    picked = initial_state.index_select(0, index)
    return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def _local_cu(layout: _Layout, device) -> Optional[Tensor]:
    if layout.cu_seqlens is None:
        return None
    return torch.tensor(layout.cu_seqlens, dtype=torch.int32, device=device)


def _state_product(p: Tensor, S: Tensor) -> Tensor:
    """``[n, t, HV, K] x [n, HV, K, V] -> [n, t, HV, V]``: each token's row of ``p`` times its state.

    One batched GEMM over the heads per sequence, in ``p``'s dtype (bf16 tensor cores on the GPU,
    float32 accumulation; the op itself keeps chunk states in the input dtype). ``p``'s ``[t, K]``
    rows of one head form a strided matrix that the GEMM reads in place, no transposed copy.
    """
    S = S.to(p.dtype)
    out = [torch.bmm(p[b].transpose(0, 1), S[b]).transpose(0, 1) for b in range(p.shape[0])]
    return out[0].unsqueeze(0) if len(out) == 1 else torch.stack(out)


def _apply_correction(o_fresh: Tensor, layout: _Layout, S_in: Tensor, p_of: Callable) -> Tensor:
    """``o = o_fresh + S_in^T p_t`` on the carried sequences (fresh ones have ``S_in = 0``: unchanged).

    ``p_of(start, end)`` gives ``p`` for tokens ``start:end`` of every row, ``[B, t, HV, K]``.
    """
    if layout.cu_seqlens is None:
        return o_fresh + _state_product(p_of(0, o_fresh.shape[1]), S_in).to(o_fresh.dtype)
    pieces, cursor = [], 0
    for i, (start, end) in enumerate(layout.spans):
        if not layout.carry[i] or end == start:
            continue
        if start > cursor:
            pieces.append(o_fresh[:, cursor:start])
        pieces.append(o_fresh[:, start:end] + _state_product(p_of(start, end), S_in[i:i + 1]).to(o_fresh.dtype))
        cursor = end
    if cursor < o_fresh.shape[1]:
        pieces.append(o_fresh[:, cursor:])
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]


def _op_pass(call: _Call, layout: _Layout) -> _Pass:
    """Transfer through the op itself: ``v <- [v | 0_K]``, carried rows start from ``[0 | I]``."""
    named = call.named
    q, v, initial_state = named["q"], named["v"], named["initial_state"]
    B, T, H, HV, K, V = call.shape
    cu = _local_cu(layout, q.device)
    fresh = _fresh_initial_state(initial_state, layout, q)
    L = layout.count
    if not any(layout.carry):
        o, final = call.run(initial_state=fresh, output_final_state=True, cu_seqlens=cu)
        return _Pass(o, final, None, layout, correction=None)

    if layout.cu_seqlens is not None and L > 1 and layout.carry[0] and not any(layout.carry[1:]):
        return _split_off_first(call, layout)

    carry = torch.tensor(layout.carry, device=q.device, dtype=torch.float32).view(L, 1, 1, 1)
    identity = torch.eye(K, device=q.device, dtype=torch.float32).expand(L, HV, K, K) * carry
    max_v = call.info.get("max_v") if call.info else None
    if max_v is None or V + K <= max_v:
        # one call: [v | 0] values, [S0 | I] start states -> outputs [o | p], final states [N | M]
        wide_v = torch.cat([v, v.new_zeros(B, T, HV, K)], dim=-1)
        start = torch.zeros(L, HV, K, V, device=q.device, dtype=torch.float32) if fresh is None else fresh
        wide_h0 = torch.cat([start.to(torch.float32), identity], dim=-1)
        o_wide, final_wide = call.run(v=wide_v, initial_state=wide_h0, output_final_state=True, cu_seqlens=cu)
        o_fresh, p = o_wide[..., :V], o_wide[..., V:]
        final_N, final_M = final_wide[..., :V], final_wide[..., V:]
    else:
        # the widened values would pass the spec's max_v: two calls of the normal widths
        o_fresh, final_N = call.run(initial_state=fresh, output_final_state=True, cu_seqlens=cu)
        p, final_M = call.run(v=v.new_zeros(B, T, HV, K), initial_state=identity.contiguous(),
                              output_final_state=True, cu_seqlens=cu)

    return _Pass(o_fresh, final_N, final_M, layout,
                 correction=lambda o, S_in: _apply_correction(o, layout, S_in, lambda lo, hi: p[:, lo:hi]))


def _split_off_first(call: _Call, layout: _Layout) -> _Pass:
    """A packed shard whose first sequence alone carries state in (context parallelism with
    varlen): only that sequence's tokens go through the widened pass, the rest through the plain op."""
    cut = layout.spans[0][1]
    tokens = {n: x for n, x in call.named.items() if n in _PER_TOKEN and isinstance(x, Tensor)}
    head = _Layout([0, cut], layout.spans[:1], [True], layout.init_rows[:1])
    rest_spans = [(a - cut, b - cut) for a, b in layout.spans[1:]]
    rest = _Layout([0] + [b for _, b in rest_spans], rest_spans, layout.carry[1:], layout.init_rows[1:])
    first = _op_pass(call.with_args(**{n: x[:, :cut] for n, x in tokens.items()}), head)
    others = _op_pass(call.with_args(**{n: x[:, cut:] for n, x in tokens.items()}), rest)
    HV, K = first.final_M.shape[1], first.final_M.shape[-1]
    final_M = torch.cat([first.final_M, first.final_M.new_zeros(rest.count, HV, K, K)])

    def correction(o, S_in):
        return torch.cat([first.outputs(S_in[:1]), o[:, cut:]], dim=1)
    return _Pass(torch.cat([first.o_fresh, others.o_fresh], dim=1), torch.cat([first.final_N, others.final_N]),
                 final_M, layout, correction=correction)


def _closed_form_pass(call: _Call, layout: _Layout, decay: str) -> _Pass:
    """Additive family: ``M`` and ``p`` from the gates (the op runs once at its normal width)."""
    named = call.named
    q, initial_state = named["q"], named["initial_state"]
    B, T, H, HV, K, V = call.shape
    cu = _local_cu(layout, q.device)
    fresh = _fresh_initial_state(initial_state, layout, q)
    o_fresh, final_N = call.run(initial_state=fresh, output_final_state=True, cu_seqlens=cu)
    if not any(layout.carry):
        return _Pass(o_fresh, final_N, None, layout, correction=None)

    scale = named.get("scale")
    scale = K ** -0.5 if scale is None else float(scale)
    g = named.get("g") if decay != "none" else None
    if g is not None:
        # the gates stage's floor (NaN stays NaN), then the running log-decay in float32
        g = g.float()
        g = torch.where(g < _LOG_DECAY_FLOOR, torch.full_like(g, _LOG_DECAY_FLOOR), g)

    def p_of(start, end):
        """p_t = scale * q_t (decay none), times exp(cumulative log-decay) per head or key channel."""
        p = q[:, start:end].float() * scale
        if HV != H:
            p = p.repeat_interleave(HV // H, dim=2)       # value head hv reads q head hv // (HV // H)
        if g is not None:
            decay_to_t = torch.exp(torch.cumsum(g[:, start:end], dim=1))
            p = p * (decay_to_t.unsqueeze(-1) if decay == "scalar" else decay_to_t)
        return p.to(o_fresh.dtype if o_fresh.dtype in (torch.float16, torch.bfloat16) else torch.float32)

    # transitions of the carried sequences: I, exp(sum g) I or diag(exp(sum g)); 0 for fresh rows
    carried = [i for i in range(layout.count) if layout.carry[i]]
    if g is None:
        log_total = torch.zeros(len(carried), HV, K, device=q.device)
    elif layout.cu_seqlens is None:
        log_total = g[carried].sum(dim=1)                      # [n, HV] or [n, HV, K]
    else:
        log_total = torch.stack([g[0, slice(*layout.spans[i])].sum(dim=0) for i in carried])
    if log_total.dim() == 2:                                   # scalar decay: the same on every key channel
        log_total = log_total.unsqueeze(-1).expand(-1, -1, K)
    final_M = torch.zeros(layout.count, HV, K, K, device=q.device, dtype=torch.float32).index_copy(
        0, torch.tensor(carried, device=q.device), torch.diag_embed(torch.exp(log_total)))
    return _Pass(o_fresh, final_N, final_M, layout,
                 correction=lambda o, S_in: _apply_correction(o, layout, S_in, p_of))


def _local_pass(call: _Call, layout: _Layout, transfer: str) -> _Pass:
    decay = call.closed_form_decay()
    if transfer == "op" or decay is None:
        return _op_pass(call, layout)
    return _closed_form_pass(call, layout, decay)


# =============================================================================================
# Layouts: which local sequences a piece of the token range holds
# =============================================================================================

@dataclass
class _Piece:
    """One shard or segment of the packed token range [start, end)."""

    layout: _Layout
    seq_ids: list          # global sequence id of every local sequence
    ends_sequence: list    # whether the local sequence ends its global sequence here


def _packed_piece(offsets: list, start: int, end: int, has_init: bool) -> _Piece:
    """The local sequences of tokens [start, end) of a packed batch with global ``offsets``."""
    spans, carry, init_rows, seq_ids, ends = [], [], [], [], []
    for n in range(len(offsets) - 1):
        bos, eos = offsets[n], offsets[n + 1]
        lo, hi = max(bos, start), min(eos, end)
        if hi <= lo:
            continue
        continues = bos < start
        spans.append((lo - start, hi - start))
        carry.append(continues)
        init_rows.append(n if has_init and not continues else -1)
        seq_ids.append(n)
        ends.append(hi == eos)
    cu = [0] + [s[1] for s in spans]
    return _Piece(_Layout(cu, spans, carry, init_rows), seq_ids, ends)


def _host_offsets(cu_seqlens) -> list:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [0, ..., T], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0, got {offsets[:8]}...")
    return offsets


# =============================================================================================
# Across ranks: torch.distributed
# =============================================================================================

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


def _rank_plan(call: _Call, rank: int, world: int, group=None) -> _RankPlan:
    B, T, H, HV, K, V = call.shape
    has_init = call.named["initial_state"] is not None
    cu_seqlens = call.named["cu_seqlens"]
    if cu_seqlens is None:
        layout = _Layout(None, [(0, T)] * B, [rank > 0] * B,
                         [b if (rank == 0 and has_init) else -1 for b in range(B)])
        owned = [(b, b) for b in range(B)] if rank == world - 1 else []
        return _RankPlan(rank, world, layout, list(range(B)), owned, B)
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen inputs are packed as B=1, got q of shape {tuple(call.named['q'].shape)}")
    offsets = _host_offsets(cu_seqlens)
    starts = _shard_starts(T, group, world, call.named["q"].device)
    if offsets[-1] != starts[-1]:
        raise ValueError(f"cu_seqlens: the global offsets end at {offsets[-1]}, but the {world} ranks' shards hold "
                         f"{starts[-1]} tokens; pass the global cu_seqlens of the packed batch on every rank")
    start = starts[rank]
    piece = _packed_piece(offsets, start, start + T, has_init)
    if piece.layout.count == 0:
        raise ValueError(f"cu_seqlens: rank {rank} holds no tokens (T={T})")
    owned = [(n, i) for i, (n, ends) in enumerate(zip(piece.seq_ids, piece.ends_sequence)) if ends]
    if rank == 0:       # an empty sequence's final state is its initial state: rank 0 reports it
        owned += [(n, None) for n in range(len(offsets) - 1) if offsets[n] == offsets[n + 1]]
    return _RankPlan(rank, world, piece.layout, [piece.layout.count - 1], owned, len(offsets) - 1)


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
        V = start.shape[-1]
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


def _default_group(group):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; call torch.distributed.init_process_group "
                         "(torchrun sets the environment) before context_parallel")
    return group if group is not None else dist.group.WORLD


def _normalized(call: _Call):
    """linear_attn's normalize=True: the normaliser is one more value column starting at 0 (as the op)."""
    if not call.named.get("normalize"):
        return call, None
    v, h0 = call.named["v"], call.named["initial_state"]
    V = v.shape[-1]
    changes = dict(v=torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), normalize=False)
    if h0 is not None:
        changes["initial_state"] = torch.cat([h0, torch.zeros_like(h0[..., :1])], dim=-1)

    def finish(o, final):
        return o[..., :V] / o[..., V:], (final[..., :V].contiguous() if final is not None else None)
    return call.with_args(**changes), finish


def context_parallel(fn: Callable, *args, group=None, transfer: str = "auto", **kwargs):
    """Run a chunk op on one shard of the token dimension per rank of ``group``, exactly.

    Call it on every rank of ``group`` with the same arguments as ``fn`` (a generated
    ``chunk_<name>``, e.g. ``generated.gated_delta_rule.chunk_gated_delta_rule``), except that the
    per-token tensors (q, k, v, g, beta) hold this rank's contiguous slice of the sequence dim,
    in rank order (see :func:`shard_tokens`; shards may differ in length, e.g. :func:`shard_sizes`
    gives rank 0, which runs the plain op, a larger share). Every rank must pass the same
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

    ``transfer``: 'auto' (default) uses the closed-form transition for the additive family and the
    op's widened pass otherwise; 'op' always uses the op; 'closed_form' insists on the closed form.
    Communication per call: one all_gather of ``[P, HV, K, V + K]`` float32 (P = B, or 1 for varlen;
    varlen adds one of the shard lengths) and, with ``output_final_state``, one all_reduce of the
    final states; in backward one all_gather of ``[P, HV, K, V]`` and the all_reduce again.
    """
    call = _Call.bind(fn, args, kwargs)
    _check_transfer(call, transfer)
    group = _default_group(group)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    if world == 1:
        return call.run()
    call, finish = _normalized(call)
    plan = _rank_plan(call, rank, world, group)
    names = [n for n, x in call.named.items() if isinstance(x, Tensor) and n != "cu_seqlens"]
    tensors = [call.named[n] for n in names]
    needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
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


def shard_tokens(x: Optional[Tensor], group=None, dim: int = 1, sizes: Optional[list] = None) -> Optional[Tensor]:
    """This rank's contiguous slice of ``x`` along ``dim`` (the token dim of ``[B, T, ...]`` tensors).

    Equal slices by default; ``sizes`` (one count per rank, e.g. from :func:`shard_sizes`) otherwise.
    """
    if x is None:
        return None
    group = _default_group(group)
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    if sizes is None:
        if x.shape[dim] % world:
            raise ValueError(f"x: dim {dim} of shape {tuple(x.shape)} does not split into {world} equal shards")
        return x.chunk(world, dim=dim)[rank]
    if len(sizes) != world or sum(sizes) != x.shape[dim]:
        raise ValueError(f"sizes: expected {world} counts summing to {x.shape[dim]} (dim {dim} of x), got {sizes}")
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


# =============================================================================================
# Within one device: segments of long sequences as a batch
# =============================================================================================

def choose_segments(fn: Callable, *args, **kwargs) -> int:
    """The segment count ``split_sequence_forward(fn, *args, segments="auto", **kwargs)`` uses (1: no split).

    The tuner's measured choice for the call's shape class (``gdngen tune ... --stages split``: every
    count checked against the unsplit call, then timed; a count must beat no split to win), and 1
    where the cache has none (untuned shapes, CPU, a function that is not a generated op). No guess
    by SM count: the delta rule's split runs the op at ``V + K`` width, and on the H200 every split
    measured about twice the plain op, including where B * HV leaves most SMs idle ((1,32768,2,8)
    K=V=128 bf16: 1.20 ms unsplit, 2.12-3.44 ms at 2-16 segments; (1,131072,16,32): 7.82 vs 14.8 ms;
    benchmarks/results/2026-11-30-h200-stop18-split.txt).
    """
    call = _Call.bind(fn, args, kwargs)
    sequences, longest, _ = _sequence_extent(call)
    return _auto_segments(call, sequences, longest)


def _sequence_extent(call: _Call):
    """(sequences, longest sequence's tokens, host offsets or None) of a call."""
    B, T = call.shape[:2]
    cu_seqlens = call.named["cu_seqlens"]
    if cu_seqlens is None:
        return B, T, None
    offsets = _host_offsets(cu_seqlens)
    return len(offsets) - 1, max((b - a for a, b in zip(offsets, offsets[1:])), default=0), offsets


def _auto_segments(call: _Call, sequences: int, longest: int) -> int:
    """segments='auto': the tuner's count, or no split."""
    return _tuned_segments(call, sequences, longest) or 1


def _tuned_segments(call: _Call, sequences: int, longest: int) -> Optional[int]:
    """The tuner's segment count for this call's shape class (``gdngen tune --stages split``), never
    leaving segments shorter than four chunks; None when untuned, off CUDA or for a foreign function."""
    name = (call.info or {}).get("name")
    if not name:
        return None
    from gdngen.autotune.cache import segments_hint
    B, T, H, HV, K, V = call.shape
    hint = segments_hint(name, K=K, V=V, BT=call.chunk_size, N=sequences, HV=HV, dtype=call.named["q"].dtype,
                         H=H, T=longest)
    if hint is None:
        return None
    while hint > 1 and longest // hint < 4 * call.chunk_size:
        hint //= 2
    return hint


def _split_pieces(offsets: list, segment: int, has_init: bool):
    """Cut every sequence of a packed batch into pieces of ``segment`` tokens.

    Returns the layout of all pieces and, per sequence, the list of its piece rows.
    """
    spans, carry, init_rows, rows_of = [], [], [], []
    for n in range(len(offsets) - 1):
        bos, eos = offsets[n], offsets[n + 1]
        rows = []
        for lo in range(bos, eos, segment):
            rows.append(len(spans))
            spans.append((lo, min(lo + segment, eos)))
            carry.append(lo > bos)
            init_rows.append(n if has_init and lo == bos else -1)
        rows_of.append(rows)
    cu = [0] + [s[1] for s in spans]
    return _Layout(cu, spans, carry, init_rows), rows_of


def _scan_pieces(local: _Pass, rows_of: list) -> Optional[Tensor]:
    """Start state of every piece: ``S <- M S + N`` along each sequence's pieces, all sequences at once."""
    if local.final_M is None:
        return None
    N_, M_ = local.final_N, local.final_M
    count = max((len(r) for r in rows_of), default=0)
    table = [r + [r[-1] if r else 0] * (count - len(r)) for r in rows_of if r]
    index = torch.tensor(table, device=N_.device)                     # [n_seq, count] piece rows
    state = torch.zeros_like(N_[index[:, 0]])
    states = [state]
    for j in range(1, count):
        prev = index[:, j - 1]
        state = M_[prev] @ state + N_[prev]
        states.append(state)
    stacked = torch.stack(states, dim=1).flatten(0, 1)                # [(n_seq * count), HV, K, V]
    where = [0] * local.layout.count
    for s, rows in enumerate([r for r in rows_of if r]):
        for j, row in enumerate(rows):
            where[row] = s * count + j
    return stacked.index_select(0, torch.tensor(where, device=N_.device))


def split_sequence_forward(fn: Callable, *args, segments="auto", transfer: str = "auto", **kwargs):
    """A chunk op on one device with each long sequence cut into segments computed side by side.

    Same arguments and results as ``fn`` (a generated ``chunk_<name>``), plus ``segments``: an int
    (1 = no split) or 'auto' (:func:`choose_segments`: the tuner's measured count for the shape
    class, ``gdngen tune --stages split``, else 1 -- no split unless measured faster). Each
    sequence is cut into ``segments`` pieces (lengths rounded up to the chunk size); one call of
    the op computes every piece from a zero start together with its transfer ``(M, N)``, a scan
    over the pieces gives their true start states, and each piece's outputs are corrected by
    ``S_start^T p_t`` -- exact, equal to the unsplit call up to float rounding: the pieces run on
    the kernel paths the unsplit call takes (:meth:`_Call.same_paths_as`), so with bf16 inputs
    only the tokens just past a piece boundary differ (rounded through the correction).
    Differentiable (plain autograd, one backward pass of the op). Packed varlen batches are split
    per sequence. ``transfer`` as in :func:`context_parallel`.
    """
    call = _Call.bind(fn, args, kwargs)
    _check_transfer(call, transfer)
    B, T, H, HV, K, V = call.shape
    cu_seqlens = call.named["cu_seqlens"]
    sequences, longest, offsets = _sequence_extent(call)
    if segments == "auto":
        segments = _auto_segments(call, sequences, longest)
    elif isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments: expected a positive int or 'auto', got {segments!r}")
    chunk = call.chunk_size
    segment = -(-max(longest, 1) // segments)
    segment = -(-segment // chunk) * chunk              # whole chunks: chunk boundaries stay put
    if segments == 1 or segment >= longest:
        return call.run()

    call, finish = _normalized(call)
    has_init = call.named["initial_state"] is not None
    output_final_state = bool(call.named["output_final_state"])
    if offsets is None:
        # dense rows: pack [B, T] as B sequences of T tokens (a view when T is a whole number of segments)
        offsets = [b * T for b in range(B + 1)]
    layout, rows_of = _split_pieces(offsets, segment, has_init)
    packed = {name: call.named[name].reshape(1, B * T, *call.named[name].shape[2:])
              for name in _PER_TOKEN if isinstance(call.named.get(name), Tensor)}
    local_call = call.with_args(**packed)
    dense_view = cu_seqlens is None and T % segment == 0
    if dense_view:
        # equal pieces: run them as dense rows [B * S, T / S], no cu_seqlens needed
        pieces = T // segment
        local_call = call.with_args(**{n: x.reshape(B * pieces, segment, *x.shape[2:]) for n, x in packed.items()})
        layout = _Layout(None, [(0, segment)] * (B * pieces), layout.carry, layout.init_rows)

    with call.same_paths_as(sequences):                 # the unsplit call's kernel paths (its rounding)
        local = _local_pass(local_call, layout, transfer)
    S_in = _scan_pieces(local, rows_of)
    o = local.outputs(S_in).reshape(B, T, *local.o_fresh.shape[2:])
    final = None
    if output_final_state:
        finals = local.finals(S_in)
        h0 = call.named["initial_state"]
        final = torch.stack([finals[rows[-1]] if rows else
                             (h0[n].to(torch.float32) if h0 is not None else finals.new_zeros(finals.shape[1:]))
                             for n, rows in enumerate(rows_of)], dim=0)
    return finish(o, final) if finish else (o, final)
