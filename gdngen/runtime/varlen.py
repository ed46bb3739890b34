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
