"""The grouped-value-head sum of the backward's dq and dk (``gdngen.runtime.ops.sum_head_groups``).

A row-contiguous ``[B, T, HV, K]`` tensor is ``[M, G * K]`` with M = B T H and G = HV // H; each
output row ``[K]`` is the float32 sum of its input row's G pieces in order, rounded once.
"""
import triton
import triton.language as tl

from gdngen.runtime.launch import fast


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


head_group_sum = fast(_head_group_sum_kernel)   # cached launch path (gdngen.runtime.launch.fast)
