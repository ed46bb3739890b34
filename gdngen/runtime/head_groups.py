"""The grouped-value-head sum of the backward's dq and dk.

A row-contiguous ``[B, T, HV, K]`` tensor is ``[M, G * K]`` with M = B T H and G = HV // H; each
output row ``[K]`` is the float32 sum of its input row's G pieces in order, rounded once.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from gdngen.runtime.launch import cdiv, fast, next_pow2, runs_kernels
from gdngen.runtime.ops import sum_head_groups_torch


@triton.jit
def _head_group_sum_kernel(x, y, M, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    """BM rows of [M, G * K] -> [M, K] per program."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    mask = (o_m < M)[:, None] & (o_k < K)[None, :]
    row = o_m.to(tl.int64)[:, None]
    acc = tl.load(x + row * (G * K) + o_k[None, :], mask=mask, other=0.).to(tl.float32)
    for j in tl.static_range(1, G):
        acc += tl.load(x + row * (G * K) + j * K + o_k[None, :], mask=mask, other=0.).to(tl.float32)
    tl.store(y + row * K + o_k[None, :], acc.to(y.dtype.element_ty), mask=mask)


_head_group_sum_fast = fast(_head_group_sum_kernel)   # cached launch path (gdngen.runtime.launch.fast)


def sum_head_groups(x: torch.Tensor, H: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T, HV, K]`` per value head -> ``[B, T, H, K]``: each query/key head's HV // H value
    heads summed in a fixed order (deterministic, no atomics), in float32, rounded once: bit for bit
    ``gdngen.runtime.ops.sum_head_groups_torch``. ``out``: a ``[B, T, H, K]`` tensor (a view of a
    larger buffer too) to write the result into, and return, instead of a new one.

    One kernel streams whole rows, where torch's elementwise adds of the strided ``[:, :, :, j]``
    views ran at about half the memory bandwidth (dq and dk at (4, 8192, 16, 32), bf16, H200:
    361 -> 184 us, 402 MB each). Tensors the kernel cannot take (not CUDA and no interpreter, not
    row-contiguous) go through the torch sum."""
    B, T, HV, K = x.shape
    if HV % H:
        raise ValueError(f"H: the value heads ({HV}) must be a multiple of the query heads, got H={H}")
    y = out if out is not None else x.new_empty(B, T, H, K)
    if tuple(y.shape) != (B, T, H, K) or y.dtype != x.dtype:
        raise ValueError(f"out: expected a {x.dtype} tensor of shape {(B, T, H, K)}, got {y.dtype} {tuple(y.shape)}")
    if not (runs_kernels(x) and x.is_contiguous() and y.is_contiguous()):
        return sum_head_groups_torch(x, H, out=y)
    rows, BM = B * T * H, 32
    if rows > 0:
        _head_group_sum_fast[(cdiv(rows, BM),)](x, y, rows, G=HV // H, K=K, BK=max(16, next_pow2(K)), BM=BM,
                                                num_warps=4)
    return y
