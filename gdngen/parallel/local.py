"""The call being parallelised and one pass of the op over a piece of it (shared by
:mod:`gdngen.parallel.distributed` and :mod:`gdngen.parallel.intra_card`); see the package text."""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

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


def _check_transfer(call: _Call, transfer: str, choices: tuple = _TRANSFERS) -> None:
    if transfer not in choices:
        raise ValueError(f"transfer: expected one of {list(choices)}, got {transfer!r}")
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
