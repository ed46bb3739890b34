"""Causal depthwise short convolution (+ SiLU) as Triton kernels, varlen-aware, with a conv state.

For channel ``d`` and token ``t`` of a sequence, with window ``W``::

    y[t, d] = act(bias[d] + sum_w weight[d, w] * x[t - (W - 1) + w, d])

Inputs before the sequence start come from the conv state (``[N, D, W]``: the last ``W`` inputs
seen, oldest first -- the layout of transformers' and FLA's caches), or are zero without one.
The final state of each sequence is again its last ``W`` inputs, taken from the state where the
sequence is shorter than ``W``, so a prefill followed by token-by-token calls equals one call.

``splits`` writes the output as several contiguous tensors (q, k, v of a fused projection) in
the same pass, so the GDN op never has to copy strided slices.

Gradients flow to ``x``, ``weight``, ``bias`` and ``initial_state`` (and from ``final_state``).
The backward recomputes the pre-activation from ``x`` rather than storing it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from gdngen.runtime import chunk_tables, check_backend, next_pow2

MAX_WIDTH = 8          # the window is unrolled W x W times in the backward
_ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _load_input(x, stride_x, h0, src, o_d, m_r, m_d, bos, i_n, D, W: tl.constexpr, USE_H0: tl.constexpr):
    """float32 inputs at packed rows ``src`` (may lie before ``bos``: then from the conv state)."""
    in_x = (src >= bos) & m_r
    b_x = tl.load(x + tl.maximum(src, bos)[:, None] * stride_x + o_d[None, :],
                  mask=in_x[:, None] & m_d[None, :], other=0.).to(tl.float32)
    if USE_H0:
        # state column of an input (bos - j) is W - j: the state holds the last W inputs, oldest first
        in_h = (src < bos) & m_r
        col = tl.maximum(W + src - bos, 0)
        b_x += tl.load(h0 + i_n * D * W + o_d[None, :] * W + col[:, None],
                       mask=in_h[:, None] & m_d[None, :], other=0.).to(tl.float32)
    return b_x


@triton.jit
def _conv_pre(x, stride_x, weight, bias, h0, o_r, o_d, m_r, m_d, bos, i_n, D,
              W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr):
    """float32 pre-activation ``[BR, BD]`` of the rows ``o_r`` (all in one sequence starting at ``bos``)."""
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        b_x = _load_input(x, stride_x, h0, o_r - (W - 1) + w, o_d, m_r, m_d, bos, i_n, D, W, USE_H0)
        b_w = tl.load(weight + o_d * W + w, mask=m_d, other=0.).to(tl.float32)
        acc += b_x * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    return acc


@triton.jit
def _split_offsets(o_r, o_d, m, D, S1, S2):
    """Masks and offsets of a [rows, channels] tile in the three split outputs (widths S1, S2 - S1, D - S2)."""
    m0 = m & (o_d < S1)[None, :]
    m1 = m & ((o_d >= S1) & (o_d < S2))[None, :]
    m2 = m & (o_d >= S2)[None, :]
    p0 = o_r[:, None] * S1 + o_d[None, :]
    p1 = o_r[:, None] * (S2 - S1) + tl.maximum(o_d - S1, 0)[None, :]
    p2 = o_r[:, None] * (D - S2) + tl.maximum(o_d - S2, 0)[None, :]
    return m0, m1, m2, p0, p1, p2


@triton.jit
def _block_output(y0, y1, y2, c0, D, S1, S2, NUM_OUT: tl.constexpr):
    """(output, its row width, first column) of the channel block starting at c0, when every split
    boundary is a multiple of the block width (the block lies in one output)."""
    base, width, col = y0, S1, c0
    if NUM_OUT > 1:
        if c0 >= S1:
            base, width, col = y1, S2 - S1, c0 - S1
    if NUM_OUT > 2:
        if c0 >= S2:
            base, width, col = y2, D - S2, c0 - S2
    return base, width, col


@triton.jit
def _load_out(dy0, dy1, dy2, o_r, o_d, m, c0, D, S1, S2, BD: tl.constexpr, NUM_OUT: tl.constexpr,
              ALIGNED: tl.constexpr):
    """float32 [rows, BD] of the split outputs' gradients.  ALIGNED (every split boundary a multiple
    of BD): each channel block lies in one output, read with one load."""
    if ALIGNED:
        base, width, col = _block_output(dy0, dy1, dy2, c0, D, S1, S2, NUM_OUT)
        b = tl.load(base + o_r[:, None] * width + (col + tl.arange(0, BD))[None, :], mask=m, other=0.).to(tl.float32)
    else:
        b = _load_split(dy0, dy1, dy2, o_r, o_d, m, D, S1, S2, NUM_OUT)
    return b


@triton.jit
def _sequence_of_program(cu_seqlens, chunk_indices, i_c, i_b, T, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, first row, end row) of a chunk program."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_n = i_b.to(tl.int64)
        i_t = i_c.to(tl.int64)
        bos = i_n * T
        eos = bos + T
    return i_n, i_t, bos, eos


@triton.jit
def _short_conv_fwd_kernel(
    x, stride_x,                # [B*T, D] input rows (row stride stride_x, channels contiguous)
    weight,                     # [D, W]
    bias,                       # [D] or unused
    h0,                         # [N, D, W] conv state or unused
    y0, y1, y2,                 # outputs: channels [0, S1), [S1, S2), [S2, D), each row-contiguous
    cu_seqlens, chunk_indices,
    T, D, S1, S2,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr,
    SILU: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_OUT: tl.constexpr, ALIGNED: tl.constexpr,
):
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, eos = _sequence_of_program(cu_seqlens, chunk_indices, i_c, i_b, T, IS_VARLEN)
    o_r = bos + i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_r, m_d = o_r < eos, o_d < D
    acc = _conv_pre(x, stride_x, weight, bias, h0, o_r, o_d, m_r, m_d, bos, i_n, D, W, BT, BD, HAS_BIAS, USE_H0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    m = m_r[:, None] & m_d[None, :]
    if ALIGNED:     # the usual case: every channel block lies in one output (one store, no split masks)
        base, width, col = _block_output(y0, y1, y2, i_d * BD, D, S1, S2, NUM_OUT)
        tl.store(base + o_r[:, None] * width + (col + tl.arange(0, BD))[None, :], acc.to(y0.dtype.element_ty),
                 mask=m)
    else:
        m0, m1, m2, p0, p1, p2 = _split_offsets(o_r, o_d, m, D, S1, S2)
        tl.store(y0 + p0, acc.to(y0.dtype.element_ty), mask=m0)
        if NUM_OUT > 1:
            tl.store(y1 + p1, acc.to(y1.dtype.element_ty), mask=m1)
        if NUM_OUT > 2:
            tl.store(y2 + p2, acc.to(y2.dtype.element_ty), mask=m2)


@triton.jit
def _short_conv_final_state_kernel(
    x, stride_x, h0, ht, cu_seqlens, T, D,
    W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """ht[n, :, c] = the input at position eos - W + c (from the old state when that lies before bos).

    ``ht`` may be ``h0`` itself (an in-place update): each program loads its whole slice before storing.
    """
    i_d, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
    o_c = tl.arange(0, WP)
    o_d = i_d * BD + tl.arange(0, BD)
    m_c, m_d = o_c < W, o_d < D
    b_s = _load_input(x, stride_x, h0, eos - W + o_c, o_d, m_c, m_d, bos, i_n, D, W, USE_H0)
    tl.store(ht + i_n * D * W + o_d[None, :] * W + o_c[:, None], b_s.to(ht.dtype.element_ty),
             mask=m_c[:, None] & m_d[None, :])


@triton.jit
def _load_split(dy0, dy1, dy2, o_r, o_d, m, D, S1, S2, NUM_OUT: tl.constexpr):
    m0, m1, m2, p0, p1, p2 = _split_offsets(o_r, o_d, m, D, S1, S2)
    b = tl.load(dy0 + p0, mask=m0, other=0.).to(tl.float32)
    if NUM_OUT > 1:
        b += tl.load(dy1 + p1, mask=m1, other=0.).to(tl.float32)
    if NUM_OUT > 2:
        b += tl.load(dy2 + p2, mask=m2, other=0.).to(tl.float32)
    return b


@triton.jit
def _activation_grad(pre, dy, SILU: tl.constexpr):
    if SILU:
        s = tl.sigmoid(pre)
        return dy * s * (1. + pre * (1. - s))
    return dy


@triton.jit
def _short_conv_bwd_kernel(
    x, stride_x, weight, bias, h0,
    dy0, dy1, dy2,              # output gradients, split like the outputs
    dht,                        # [N, D, W] gradient of the final state, or unused
    dx, stride_dx,              # [B*T, D] rows of channels (row stride stride_dx, channels contiguous)
    dw_part, db_part,           # [P, D, W], [P, D] float32 per-program partial sums (P = chunk programs)
    cu_seqlens, chunk_indices,
    T, D, S1, S2,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr,
    SILU: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_OUT: tl.constexpr, USE_DHT: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """dx[t] = sum_j weight[W-1-j] * dpre[t + j] (same sequence); dweight, dbias as partial sums.

    Tiles of BT rows step by BS = BT - W + 1 and overlap by W - 1: a program owns (writes dx of)
    its first BS rows and reads the next W - 1 rows' output gradients.  The pre-activation and
    dpre are formed once per tile row (one sigmoid per element); the shifted dpre[t + j] come
    from the tile itself (tl.gather along time), not from a recomputation.
    """
    BS: tl.constexpr = BT - W + 1
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_p = (i_b * tl.num_programs(1) + i_c).to(tl.int64)
    i_n, i_t, bos, eos = _sequence_of_program(cu_seqlens, chunk_indices, i_c, i_b, T, IS_VARLEN)
    o_i = tl.arange(0, BT)
    o_r = bos + i_t * BS + o_i
    o_d = i_d * BD + tl.arange(0, BD)
    m_r, m_d = o_r < eos, o_d < D
    own = m_r & (o_i < BS)
    m = m_r[:, None] & m_d[None, :]
    pre = _conv_pre(x, stride_x, weight, bias, h0, o_r, o_d, m_r, m_d, bos, i_n, D, W, BT, BD, HAS_BIAS, USE_H0)
    dy = _load_out(dy0, dy1, dy2, o_r, o_d, m, i_d * BD, D, S1, S2, BD, NUM_OUT, ALIGNED)
    dpre = _activation_grad(pre, dy, SILU)            # zero past eos: dy is masked there
    b_dx = dpre * tl.load(weight + o_d * W + (W - 1), mask=m_d, other=0.).to(tl.float32)[None, :]
    for j in tl.static_range(1, W):
        # owned rows t < BS read t + j <= BT - 1: inside the tile
        idx = tl.broadcast_to(tl.minimum(o_i + j, BT - 1)[:, None], [BT, BD])
        b_w = tl.load(weight + o_d * W + (W - 1 - j), mask=m_d, other=0.).to(tl.float32)
        b_dx += tl.gather(dpre, idx, 0) * b_w[None, :]
    # this program's own outputs: their share of dweight and dbias
    dpre = tl.where(own[:, None], dpre, 0.)
    if HAS_BIAS:
        tl.store(db_part + i_p * D + o_d, tl.sum(dpre, axis=0), mask=m_d)
    for w in tl.static_range(W):
        b_x = _load_input(x, stride_x, h0, o_r - (W - 1) + w, o_d, own, m_d, bos, i_n, D, W, USE_H0)
        tl.store(dw_part + (i_p * D + o_d) * W + w, tl.sum(dpre * b_x, axis=0), mask=m_d)
    if USE_DHT:
        # the final state holds the last W inputs: input t is its column t - (eos - W)
        col = o_r - (eos - W)
        b_dx += tl.load(dht + i_n * D * W + o_d[None, :] * W + tl.maximum(col, 0)[:, None],
                        mask=(own & (col >= 0))[:, None] & m_d[None, :], other=0.).to(tl.float32)
    tl.store(dx + o_r[:, None] * stride_dx + o_d[None, :], b_dx.to(dx.dtype.element_ty),
             mask=own[:, None] & m_d[None, :])


@triton.jit
def _short_conv_state_bwd_kernel(
    x, stride_x, weight, bias, h0, dy0, dy1, dy2, dht, dh0, cu_seqlens,
    T, D, S1, S2,
    W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, USE_H0: tl.constexpr,
    SILU: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_OUT: tl.constexpr, USE_DHT: tl.constexpr,
):
    """Gradient of the initial conv state: column c (input bos - W + c) feeds outputs bos .. bos + c - 1."""
    i_d, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
    o_j = tl.arange(0, WP)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = bos + o_j
    m_j = (o_j < W - 1) & (rows < eos)
    pre = _conv_pre(x, stride_x, weight, bias, h0, rows, o_d, m_j, m_d, bos, i_n, D, W, WP, BD, HAS_BIAS, USE_H0)
    dy = _load_split(dy0, dy1, dy2, rows, o_d, m_j[:, None] & m_d[None, :], D, S1, S2, NUM_OUT)
    dpre = _activation_grad(pre, dy, SILU)
    for c in tl.static_range(W):
        acc = tl.zeros([BD], dtype=tl.float32)
        for w in tl.static_range(c):
            # output bos + (c - 1 - w) reads column c through tap w
            b_w = tl.load(weight + o_d * W + w, mask=m_d, other=0.).to(tl.float32)
            acc += b_w * tl.sum(tl.where(o_j[:, None] == c - 1 - w, dpre, 0.), axis=0)
        if USE_DHT:
            # a sequence shorter than W passes state columns L .. W-1 on to final columns 0 .. W-1-L
            idx = o_d * 0 + (c - (eos - bos))        # as a vector: a scalar mask is not portable
            acc += tl.load(dht + i_n * D * W + o_d * W + tl.maximum(idx, 0), mask=m_d & (idx >= 0),
                           other=0.).to(tl.float32)
        tl.store(dh0 + i_n * D * W + o_d * W + c, acc.to(dh0.dtype.element_ty), mask=m_d)


def _tiles(x: torch.Tensor, D: int, use_h0: bool = False) -> tuple[int, int]:
    """(BT, BD): wide channel blocks under the interpreter (fewer programs), 64 x 64 on the GPU; with
    a conv state 64 x 32 (its per-element state loads spill at 64 x 64: 220 bytes, sm_90 offline)."""
    if x.device.type == "cpu":
        return 64, min(128, max(16, next_pow2(D)))
    return 64, min(32 if use_h0 else 64, max(16, next_pow2(D)))


def _bwd_tiles(x: torch.Tensor, D: int, use_h0: bool = False) -> tuple[int, int, int]:
    """(BT, BD, num_warps) of the backward.  On the GPU 128 x 32 tiles at 4 warps: no spills, 218
    registers, 2.6 warp instructions per element for sm_90 (64 x 64: 247 registers, 2.7 and 4.7% of
    the rows computed twice; 8 warps: 111 registers but 3.4); BT - W + 1 rows are owned per tile.
    With a conv state 64 x 16 (128 x 32 spills 56-80 bytes, 350+ varlen)."""
    if x.device.type == "cpu":
        return 64, min(128, max(16, next_pow2(D))), 4
    if use_h0:
        return 64, 16, 4
    return 128, min(32, max(16, next_pow2(D))), 4


def _aligned(splits, BD: int) -> bool:
    """Every split boundary on a channel-block boundary: each block reads/writes one output."""
    return all(s % BD == 0 for s in splits[:-1])


def _problem(x, cu_seqlens, BT):
    """(grid dims over chunks and batch, chunk_indices or None, N)."""
    B, T = x.shape[0], x.shape[1]
    if cu_seqlens is None:
        return triton.cdiv(T, BT), B, None, B
    chunk_indices, _ = chunk_tables(cu_seqlens, BT)
    return chunk_indices.shape[0], 1, chunk_indices, cu_seqlens.numel() - 1


def _row_stride(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as rows of channels with one row stride (a slice of a wider projection needs no copy)."""
    B, T, D = x.shape
    if x.stride(2) != 1 and D > 1:
        x = x.contiguous()
    if T == 1:
        return x, x.stride(0)            # rows are the batch entries
    if B > 1 and x.stride(0) != T * x.stride(1):
        x = x.contiguous()
    return x, x.stride(1)


class _ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, splits, silu, output_final_state):
        B, T, D = x.shape
        W = weight.shape[1]
        x, stride_x = _row_stride(x)
        weight = weight.contiguous()
        initial_state = None if initial_state is None else initial_state.contiguous()
        BT, BD = _tiles(x, D, initial_state is not None)
        NT, NB, chunk_indices, N = _problem(x, cu_seqlens, BT)
        S1, S2 = (splits[0], splits[0] + splits[1]) if len(splits) == 3 else \
            ((splits[0], D) if len(splits) == 2 else (D, D))
        outs = [x.new_empty(B, T, s) for s in splits]
        use_h0 = initial_state is not None
        if NT > 0 and D > 0:
            y = outs + [outs[0]] * (3 - len(outs))
            _short_conv_fwd_kernel[(triton.cdiv(D, BD), NT, NB)](
                x, stride_x, weight, bias, initial_state, y[0], y[1], y[2], cu_seqlens, chunk_indices,
                T, D, S1, S2, W=W, BT=BT, BD=BD, HAS_BIAS=bias is not None, USE_H0=use_h0, SILU=silu,
                IS_VARLEN=cu_seqlens is not None, NUM_OUT=len(outs), ALIGNED=_aligned(splits, BD),
            )
        if output_final_state:
            final_state = x.new_empty(N, D, W)
            if N > 0 and D > 0:
                _short_conv_final_state_kernel[(triton.cdiv(D, BD), N)](
                    x, stride_x, initial_state, final_state, cu_seqlens, T, D,
                    W=W, WP=next_pow2(W), BD=BD, USE_H0=use_h0, IS_VARLEN=cu_seqlens is not None,
                )
        else:
            final_state = x.new_empty(0)
            ctx.mark_non_differentiable(final_state)
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.meta = (stride_x, tuple(splits), S1, S2, silu, output_final_state, BT, BD, NT, NB, N)
        return (*outs, final_state)

    @staticmethod
    def backward(ctx, *grads):
        x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
        stride_x, splits, S1, S2, silu, output_final_state, BT, BD, NT, NB, N = ctx.meta
        B, T, D = x.shape[0], x.shape[1], weight.shape[0]
        W = weight.shape[1]
        dys = [torch.zeros(B, T, s, device=x.device, dtype=x.dtype) if g is None else g.contiguous()
               for g, s in zip(grads[:len(splits)], splits)]
        dy = dys + [dys[0]] * (3 - len(dys))
        dht = grads[-1] if output_final_state and grads[-1] is not None else None
        dht = None if dht is None else dht.contiguous()
        use_h0, varlen = initial_state is not None, cu_seqlens is not None
        dx = torch.empty(B, T, D, device=x.device, dtype=x.dtype)
        # backward tiles of BT rows own BT - W + 1 of them (they overlap by the window's W - 1)
        BT, BD, num_warps = _bwd_tiles(x, D, initial_state is not None)
        NT, NB, chunk_indices, _ = _problem(x, cu_seqlens, BT - W + 1)
        P = NT * NB
        # every chunk program writes its whole slice of the partial sums: no zero fill needed
        dw_part = torch.empty(P, D, W, device=x.device, dtype=torch.float32)
        db_part = torch.empty(P, D, device=x.device, dtype=torch.float32) if bias is not None else None
        flags = dict(HAS_BIAS=bias is not None, USE_H0=use_h0, SILU=silu, IS_VARLEN=varlen,
                     NUM_OUT=len(splits), USE_DHT=dht is not None)
        if P > 0 and D > 0:
            _short_conv_bwd_kernel[(triton.cdiv(D, BD), NT, NB)](
                x, stride_x, weight, bias, initial_state, dy[0], dy[1], dy[2], dht, dx, D, dw_part,
                db_part, cu_seqlens, chunk_indices, T, D, S1, S2, W=W, BT=BT, BD=BD, ALIGNED=_aligned(splits, BD), **flags,
                num_warps=num_warps,
            )
        dh0 = None
        if use_h0 and ctx.needs_input_grad[3]:
            dh0 = torch.empty_like(initial_state)
            if N > 0 and D > 0:
                _short_conv_state_bwd_kernel[(triton.cdiv(D, BD), N)](
                    x, stride_x, weight, bias, initial_state, dy[0], dy[1], dy[2], dht, dh0, cu_seqlens,
                    T, D, S1, S2, W=W, WP=max(2, next_pow2(W)), BD=BD, **flags,
                )
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dw, db, dh0, None, None, None, None


def _check(name, x, shape=None, what=""):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(x.shape)}")


def short_conv_num_sequences(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def validate_short_conv(x, weight, bias, activation, cu_seqlens, initial_state, splits) -> tuple[int, ...]:
    """Check a short-conv call; returns the output splits as a tuple of widths."""
    _check("x", x)
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    _check("weight", weight)
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight: expected shape ({D}, W) ([D, W], one window per channel of x {tuple(x.shape)}), "
                         f"got {tuple(weight.shape)}")
    W = weight.shape[1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"weight: window W={W} outside [1, {MAX_WIDTH}]")
    if bias is not None:
        _check("bias", bias, (D,), "[D]")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen inputs are packed as B=1, got x of shape {tuple(x.shape)}")
        N = cu_seqlens.numel() - 1
        if not torch.compiler.is_compiling():
            host = cu_seqlens.tolist()
            if host[0] != 0 or host[-1] != T or any(b < a for a, b in zip(host, host[1:])):
                raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {host}")
    if initial_state is not None:
        _check("initial_state", initial_state, (N, D, W), "[N, D, W]: the last W inputs of each sequence")
    for name, t in (("weight", weight), ("bias", bias), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, expected the device of x ({x.device})")
    if splits is None:
        return (D,)
    splits = tuple(int(s) for s in splits)
    if not 1 <= len(splits) <= 3 or sum(splits) != D or any(s < 0 for s in splits):
        raise ValueError(f"splits: expected 1 to 3 non-negative widths summing to D={D}, got {splits}")
    return splits


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    splits: Optional[Sequence[int]] = None,
):
    """Causal depthwise conv1d over time, then ``activation`` (``"silu"``/``"swish"`` or None).

    Args:
        x: ``[B, T, D]`` inputs (channels contiguous; a channel slice of a wider tensor is read in place).
        weight: ``[D, W]`` taps, ``W <= 8``; ``weight[:, -1]`` multiplies the current token.
        bias: optional ``[D]``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1); the window never crosses a start.
        initial_state: ``[N, D, W]`` the last ``W`` inputs before each sequence (oldest first), or None (zeros).
        output_final_state: also return the ``[N, D, W]`` state after each sequence, in x's dtype.
        splits: widths summing to ``D``: return one contiguous ``[B, T, width]`` tensor per split.

    Returns:
        ``(y, final_state)``: ``y`` is ``[B, T, D]`` in x's dtype (a tuple of tensors with ``splits``);
        ``final_state`` is None unless asked for.  Accumulation is float32.
    """
    widths = validate_short_conv(x, weight, bias, activation, cu_seqlens, initial_state, splits)
    check_backend(x)
    *outs, final_state = _ShortConvFunction.apply(
        x, weight, bias, initial_state, cu_seqlens, widths, activation is not None, bool(output_final_state))
    y = tuple(outs) if splits is not None else outs[0]
    return y, (final_state if output_final_state else None)


def short_conv_reference(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None,
                         output_final_state=False):
    """The same convolution in plain torch (any dtype, float64 included; differentiable): a test oracle."""
    B, T, D = x.shape
    W = weight.shape[1]
    spans = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, a, e) for a, e in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:])]
    ys, finals = [], []
    for n, (b, bos, eos) in enumerate(spans):
        history = initial_state[n].to(x.dtype) if initial_state is not None else x.new_zeros(D, W)
        seq = torch.cat([history, x[b, bos:eos].transpose(0, 1)], dim=1)          # [D, W + L]
        y = torch.nn.functional.conv1d(seq[None], weight.to(x.dtype)[:, None, :], None if bias is None else bias.to(x.dtype),
                                       groups=D)[0, :, 1:]                          # [D, L]
        if activation is not None:
            y = torch.nn.functional.silu(y)
        ys.append(y.transpose(0, 1))
        finals.append(seq[:, seq.shape[1] - W:])
    if cu_seqlens is None:
        y = torch.stack(ys, 0) if ys else x.new_empty(B, T, D)
    else:
        y = torch.cat(ys, 0)[None]
    final_state = torch.stack(finals, 0) if output_final_state else None
    return y, final_state
