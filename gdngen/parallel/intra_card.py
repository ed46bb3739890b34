"""The intra-card split: segments of long sequences computed as one batch (:func:`split_sequence_forward`)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from gdngen.parallel.local import (_PER_TOKEN, _Call, _Layout, _Pass, _check_transfer, _host_offsets,
                                   _local_pass, _normalized)


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
