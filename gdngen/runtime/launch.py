"""Small decisions every launcher makes the same way."""
from __future__ import annotations

import os

import torch


def check_backend(x: torch.Tensor) -> None:
    """Triton kernels run compiled on CUDA tensors, or under TRITON_INTERPRET=1 on CPU tensors."""
    if x.is_cuda:                   # (x.device builds a device object: 4x the time)
        return
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise ValueError(f"q: tensors on {x.device} need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors "
                     "(set before triton is imported)")


def contiguous(x):
    """Copy only when the last dimension is strided (the kernels take row-major rows)."""
    if x is None:
        return None
    if x.stride(-1) != 1 or not x.is_contiguous():
        return x.contiguous()
    return x


def dot_precision(dtype: torch.dtype, float32_operands: str = "tf32") -> str:
    """``input_precision`` of the kernels' dots for inputs of ``dtype``: it only acts on dots whose
    operands are float32. fp32 inputs must not silently drop to TF32 (about 3e-4 relative error)
    on the GPU: "ieee". Half-precision inputs: ``float32_operands`` for the float32 intermediates
    ("tf32"; "tf32x3", three TF32 passes at about float32 accuracy, with dtypes.intermediates: float32)."""
    if float32_operands not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"float32_operands: expected 'tf32', 'tf32x3' or 'ieee', got {float32_operands!r}")
    return "ieee" if dtype == torch.float32 else float32_operands


def solve_precision(input_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    """``input_precision`` of the wy stage's triangular-solve products, which act on float32 blocks.

    Where the solve's result is rounded to a 16-bit dtype (T, or W and U, stored in the 16-bit
    inputs' dtype) one TF32 pass is enough: on the H200 (gated_delta_rule, K=V=128, chunk 64) it
    left T 9.4e-5 from a float64 inverse against 1.5e-8 for "ieee", below bf16's (~2e-3) and fp16's
    (~3e-4) own rounding of T, and ran the stage 2.3x faster (481 -> 210 us at (1,32768,32,32):
    tensor cores instead of CUDA-core FMAs; "tf32x3" ran 510 us - benchmarks/NOTES.md, stop 26).
    A float32 result (float32 inputs, ``dtypes.intermediates: float32``, the backward's recomputed
    T) keeps "ieee"."""
    half = (torch.bfloat16, torch.float16)
    return "tf32" if input_dtype in half and out_dtype in half else "ieee"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids on the host: triton.cdiv is a constexpr function since Triton 3.4,
    about 2 us a call through its argument unwrapping (9 to 20 calls per op call)."""
    return -(-a // b)
