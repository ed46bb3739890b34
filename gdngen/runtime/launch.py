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


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids on the host: triton.cdiv is a constexpr function since Triton 3.4,
    about 2 us a call through its argument unwrapping (9 to 20 calls per op call)."""
    return -(-a // b)
