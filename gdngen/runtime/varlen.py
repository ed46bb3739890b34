"""Chunk bookkeeping for packed (varlen) batches."""
from __future__ import annotations

import torch


def chunk_tables(cu_seqlens: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (chunk_indices [NC, 2] = (sequence, chunk in sequence), chunk_offsets [N + 1]).

    Chunks are numbered globally in sequence order; a sequence of length 0 owns no chunk.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = (lengths + chunk_size - 1) // chunk_size
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64, device=cu_seqlens.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    seq = torch.repeat_interleave(torch.arange(len(counts), device=cu_seqlens.device), counts)
    within = torch.arange(len(seq), device=cu_seqlens.device) - offsets[seq]
    indices = torch.stack([seq, within], 1).to(torch.int32).contiguous()
    return indices, offsets.to(torch.int32)


def chunk_state_rows(B, T, chunk_size: int, N=None):
    """Rows of a chunk-start state tensor ``[rows, HV, K, V]`` known from shapes alone.

    ``B * ceil(T / chunk_size)`` for a padded batch. For ``N`` packed sequences of ``T`` tokens in
    all (``B == 1``) the exact count depends on the lengths, so this is its bound
    ``floor((T + N * (chunk_size - 1)) / chunk_size)`` (each sequence adds at most one partial
    chunk): the forward op returns its states at this size so that its fake (torch.compile)
    implementation, which sees no lengths, agrees with it. Works on SymInts.
    """
    if N is None:
        return B * ((T + chunk_size - 1) // chunk_size)
    return (T + N * (chunk_size - 1)) // chunk_size
