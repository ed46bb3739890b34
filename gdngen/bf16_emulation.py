"""A bf16-faithful Triton interpreter for CPU precision work (issues #7, #10).

The CPU tier runs the generated kernels under ``TRITON_INTERPRET=1``, whose bf16 arithmetic is not
the GPU's; :func:`patch_bf16_interpreter` makes it so, closely enough to reproduce H200 errors (GDN
forward o: 3.317e-3 emulated vs 3.33e-3 measured; linear_attn dq 1.058e-2 vs 1.056e-2).
"""
from __future__ import annotations

import numpy as np
import torch


def patch_bf16_interpreter(tf32_mode: str = "off"):
    """Make the Triton interpreter round like the H200 does, module-wide; returns an undo function.

    The interpreter stores bf16 as uint16 and multiplies the raw bits in ``tl.dot`` (garbage), and its
    float32 -> bf16 cast truncates. Patched: ``tl.dot`` upcasts bf16 operands to float32 and
    accumulates in float32 (as the tensor cores do), and float32 -> bf16 rounds to nearest even (as
    ``cvt.rn.bf16.f32`` does). ``tf32_mode`` ("off", "truncate", "round") also makes float32 dots
    that ask for TF32 drop their operands to TF32 (truncated, or rounded as ``cvt.rna.tf32.f32``).
    Used by tests/test_bf16_emulation_cpu.py and benchmarks/precision_study.py.
    """
    if tf32_mode not in ("off", "truncate", "round"):
        raise ValueError(f"tf32_mode: expected 'off', 'truncate' or 'round', got {tf32_mode!r}")
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    saved = {name: getattr(builder, name) for name in
             ("create_dot", "cast_impl", "create_fp_trunc", "create_fp_to_fp")}
    dot, cast, fp_to_fp = saved["create_dot"], saved["cast_impl"], saved["create_fp_to_fp"]

    def as_f32(x):
        if x.dtype.scalar == tl.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(x.data)).view(torch.bfloat16).float().numpy()
        return x.data.astype(np.float32)

    def to_tf32(a):
        bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        if tf32_mode == "round":           # nearest, ties away (cvt.rna.tf32.f32)
            bits = bits + np.uint32(1 << 12)
        return (bits & np.uint32(0xFFFFE000)).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if {tl.bfloat16, tl.float16} & {a.dtype.scalar, b.dtype.scalar}:     # 16-bit products are exact in float32
            return interp.TensorHandle(np.matmul(as_f32(a), as_f32(b), dtype=np.float32) + d.data, d.dtype.scalar)
        precision = str(input_precision).lower()
        if tf32_mode != "off" and a.dtype.scalar == tl.float32 and "tf32" in precision and "x3" not in precision:
            return interp.TensorHandle(np.matmul(to_tf32(a.data), to_tf32(b.data), dtype=np.float32) + d.data,
                                       d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def to_bf16(src):
        t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return interp.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: cast_impl(self, src, dst_type)
    builder.create_fp_to_fp = create_fp_to_fp

    def undo():
        for name, fn in saved.items():
            setattr(builder, name, fn)
    return undo


__all__ = ["patch_bf16_interpreter"]
