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


class PieceTables:
    """A padded batch's sequences cut into chunk-aligned pieces, as the state pass's varlen tables.

    ``cu_seqlens`` [P + 1] int32: piece bounds in flattened tokens (``b * T + t``); ``chunk_offsets``
    [P] int32: each piece's first chunk in the batch's chunk numbering (``b * NT + c``, so the pieces
    write the unsplit pass's chunk-start state rows); ``piece_seq`` [P, 2] int32: each piece's sequence
    start token and sequence index; ``count``: P; ``per_sequence``: pieces per sequence (the last piece
    of sequence b is row ``b * per_sequence + per_sequence - 1``).
    """

    def __init__(self, B: int, T: int, chunk_size: int, pieces: int, device):
        NT = -(-T // chunk_size)
        piece_chunks = -(-NT // pieces)
        self.per_sequence = -(-NT // piece_chunks)
        self.count = B * self.per_sequence
        firsts = [(b, c) for b in range(B) for c in range(0, NT, piece_chunks)]
        bounds = [b * T + c * chunk_size for b, c in firsts] + [B * T]
        as_int32 = dict(dtype=torch.int32, device=device)
        self.cu_seqlens = torch.tensor(bounds, **as_int32)
        self.chunk_offsets = torch.tensor([b * NT + c for b, c in firsts], **as_int32)
        self.piece_seq = torch.tensor([[b * T, b] for b, _ in firsts], **as_int32)

    def first(self, per_piece: torch.Tensor) -> torch.Tensor:
        """Each sequence's first piece's row of a per-piece ``[P, ...]`` tensor (its start-state gradient):
        a ``[B, ...]`` view."""
        return per_piece.view(-1, self.per_sequence, *per_piece.shape[1:])[:, 0]

    def last(self, per_piece: torch.Tensor) -> torch.Tensor:
        """Each sequence's last piece's row of a per-piece ``[P, ...]`` tensor (its final state): a ``[B, ...]``
        view."""
        return per_piece.view(-1, self.per_sequence, *per_piece.shape[1:])[:, -1]


_PIECE_TABLES: dict = {}


def piece_tables(B: int, T: int, chunk_size: int, pieces: int, device) -> PieceTables:
    """:class:`PieceTables` for a padded batch, built once per shape and device (a host-to-device copy
    on the first call only)."""
    key = (B, T, chunk_size, pieces, str(device))
    tables = _PIECE_TABLES.get(key)
    if tables is None:
        if len(_PIECE_TABLES) > 64:
            _PIECE_TABLES.clear()
        tables = _PIECE_TABLES[key] = PieceTables(B, T, chunk_size, pieces, device)
    return tables
