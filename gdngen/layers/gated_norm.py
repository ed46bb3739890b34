"""Gated RMSNorm as one fused Triton kernel, forward and backward.

Per row ``x`` of width ``V`` (a value head) with gate ``z``::

    y = x * rsqrt(mean(x^2) + eps) * weight * act(z)          act = silu (Qwen3-Next, FLA) or sigmoid

Normalise first, then gate (``norm_before_gate``, what Qwen3-Next and FLA's GatedDeltaNet do).
All arithmetic is float32; ``y`` comes out in x's dtype.  Without a gate it is a plain RMSNorm.

The rows of ``x`` and ``z`` may be strided over their second-to-last axis (a head slice of a wider
projection), so the output gate ``z`` is read in place from the fused projection output.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from gdngen.runtime import check_backend, next_pow2

_ACTIVATIONS = {"silu": 0, "swish": 0, "sigmoid": 1}


@triton.jit
def _gate(z, ACT: tl.constexpr):
    s = tl.sigmoid(z)
    if ACT == 0:
        return z * s
    return s


@triton.jit
def _gate_grad(z, ACT: tl.constexpr):
    s = tl.sigmoid(z)
    if ACT == 0:
        return s * (1. + z * (1. - s))
    return s * (1. - s)


@triton.jit
def _row_offsets(o_r, G, s0, s1):
    """Offset of row r = m * G + g of a [M, G, V] tensor with strides (s0, s1, 1)."""
    return (o_r // G) * s0 + (o_r % G) * s1


@triton.jit
def _gated_rms_norm_fwd_kernel(
    x, z, weight, y, rstd,
    R, G, sx0, sx1, sz0, sz1, eps,
    V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, HAS_GATE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ACT: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    m_r, m_v = o_r < R, o_v < V
    m = m_r[:, None] & m_v[None, :]
    b_x = tl.load(x + _row_offsets(o_r, G, sx0, sx1)[:, None] + o_v[None, :], mask=m, other=0.).to(tl.float32)
    b_rstd = 1. / tl.sqrt(tl.sum(b_x * b_x, axis=1) / V + eps)
    b_y = b_x * b_rstd[:, None]
    if HAS_WEIGHT:
        b_y *= tl.load(weight + o_v, mask=m_v, other=0.).to(tl.float32)[None, :]
    if HAS_GATE:
        b_z = tl.load(z + _row_offsets(o_r, G, sz0, sz1)[:, None] + o_v[None, :], mask=m, other=0.).to(tl.float32)
        b_y *= _gate(b_z, ACT)
    tl.store(y + o_r[:, None] * V + o_v[None, :], b_y.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_rstd, mask=m_r)


@triton.jit
def _gated_rms_norm_bwd_kernel(
    x, z, weight, rstd, dy, dx, dz, dw_part,
    R, G, sx0, sx1, sz0, sz1, sdz0, sdz1, NB,
    V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, HAS_GATE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ACT: tl.constexpr,
):
    """Each program walks row blocks i_p, i_p + P, ... and keeps one float32 partial of dweight."""
    i_p, P = tl.program_id(0), tl.num_programs(0)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    if HAS_WEIGHT:
        b_w = tl.load(weight + o_v, mask=m_v, other=0.).to(tl.float32)
    b_dw = tl.zeros([BV], dtype=tl.float32)
    for i_blk in range(i_p, NB, P):
        o_r = tl.arange(0, BR).to(tl.int64) + i_blk * BR     # i_blk * BR < R fits int32
        m_r = o_r < R
        m = m_r[:, None] & m_v[None, :]
        b_x = tl.load(x + _row_offsets(o_r, G, sx0, sx1)[:, None] + o_v[None, :], mask=m, other=0.).to(tl.float32)
        b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.)
        b_dy = tl.load(dy + o_r[:, None] * V + o_v[None, :], mask=m, other=0.).to(tl.float32)
        b_n = b_x * b_rstd[:, None]                       # the normalised row
        if HAS_GATE:
            o_z = _row_offsets(o_r, G, sz0, sz1)[:, None] + o_v[None, :]
            b_z = tl.load(z + o_z, mask=m, other=0.).to(tl.float32)
            b_a = _gate(b_z, ACT)
            b_dyn = b_dy * b_n                            # dy * n: what the weight and the gate see
            b_dz = b_dyn * _gate_grad(b_z, ACT)
            if HAS_WEIGHT:
                b_dz *= b_w[None, :]
            tl.store(dz + _row_offsets(o_r, G, sdz0, sdz1)[:, None] + o_v[None, :], b_dz.to(dz.dtype.element_ty),
                     mask=m)
            b_dy = b_dy * b_a
        if HAS_WEIGHT:
            b_dw += tl.sum(b_dy * b_n, axis=0)
            b_dn = b_dy * b_w[None, :]
        else:
            b_dn = b_dy
        # d/dx of x * rstd(x): rstd * (dn - n * mean(dn * n))
        b_dx = b_rstd[:, None] * (b_dn - b_n * (tl.sum(b_dn * b_n, axis=1) / V)[:, None])
        tl.store(dx + o_r[:, None] * V + o_v[None, :], b_dx.to(dx.dtype.element_ty), mask=m)
    if HAS_WEIGHT:
        tl.store(dw_part + i_p * V + o_v, b_dw, mask=m_v)


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """View ``t [..., V]`` as ``[M, G, V]`` rows with strides (s0, s1, 1) without copying when possible."""
    V = t.shape[-1]
    if t.dim() == 1:
        t = t[None]
    if t.stride(-1) != 1:
        t = t.contiguous()
    lead = t.reshape(-1, V) if t.dim() == 2 else None
    if lead is not None:
        return lead, 1, lead.stride(0), 0
    # [..., G, V]: fold the leading axes into M when they are uniformly strided
    G = t.shape[-2]
    try:
        m = t.view(-1, G, V)
    except RuntimeError:
        m = t.reshape(-1, G, V).contiguous()
    return m, G, m.stride(0), m.stride(1)


class _GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps, act, dz_into=None):
        shape = x.shape
        V = shape[-1]
        xr, Gx, sx0, sx1 = _as_rows(x)
        if z is not None:
            zr, Gz, sz0, sz1 = _as_rows(z)
            if Gz != Gx:            # fold the two layouts the same way
                xr, zr = x.reshape(-1, V).contiguous(), z.reshape(-1, V).contiguous()
                Gx, sx0, sx1, sz0, sz1 = 1, V, 0, V, 0
        else:
            zr, sz0, sz1 = None, 0, 0
        R = x.numel() // V if V else 0
        y = torch.empty(shape, device=x.device, dtype=x.dtype)
        rstd = torch.empty(R, device=x.device, dtype=torch.float32)
        BV = max(16, next_pow2(V))
        BR = max(1, min(16, 4096 // BV))
        if R > 0:
            _gated_rms_norm_fwd_kernel[(triton.cdiv(R, BR),)](
                xr, zr, weight, y, rstd, R, Gx, sx0, sx1, sz0, sz1, float(eps),
                V=V, BR=BR, BV=BV, HAS_GATE=z is not None, HAS_WEIGHT=weight is not None, ACT=act,
            )
        ctx.save_for_backward(xr, zr, weight, rstd)
        ctx.meta = (shape, None if z is None else z.shape, Gx, sx0, sx1, sz0, sz1, BR, BV, act)
        ctx.dz_into = dz_into
        return y

    @staticmethod
    def backward(ctx, dy):
        xr, zr, weight, rstd = ctx.saved_tensors
        shape, z_shape, G, sx0, sx1, sz0, sz1, BR, BV, act = ctx.meta
        V = shape[-1]
        R = rstd.numel()
        dy = dy.contiguous()
        dx = torch.empty(shape, device=dy.device, dtype=xr.dtype)
        dz, sdz0, sdz1 = None, 0, 0
        if zr is not None:
            dz, sdz0, sdz1 = _gate_gradient_target(ctx.dz_into, z_shape, zr, G)
        ctx.dz_into = None
        NB = triton.cdiv(R, BR)
        P = max(1, min(NB, 4 * _sm_count(dy.device)))
        dw_part = torch.zeros(P, V, device=dy.device, dtype=torch.float32) if weight is not None else None
        if R > 0:
            _gated_rms_norm_bwd_kernel[(P,)](
                xr, zr, weight, rstd, dy, dx, dz, dw_part, R, G, sx0, sx1, sz0, sz1, sdz0, sdz1, NB,
                V=V, BR=BR, BV=BV, HAS_GATE=zr is not None, HAS_WEIGHT=weight is not None, ACT=act,
            )
        dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
        return dx, dz, dw, None, None, None


def _gate_gradient_target(into, shape, like: torch.Tensor, G: int) -> tuple[torch.Tensor, int, int]:
    """(dz, its row strides s0, s1 over [M, G, V] rows): ``into()`` when it has the gate's shape and
    folds into G-row groups without a copy (e.g. a head slice of a fused projection's gradient), else
    a new contiguous tensor."""
    V = shape[-1]
    if into is not None:
        target = into()
        if tuple(target.shape) == tuple(shape) and target.dtype == like.dtype and target.device == like.device \
                and target.numel() > 0 and target.stride(-1) == 1:
            rows, Gt, s0, s1 = _as_rows(target)
            if rows.data_ptr() == target.data_ptr() and (Gt == G or (G == 1 and Gt * V == s0 and s1 == V)):
                return target, (s0 if Gt == G else V), (s1 if Gt == G else 0)
    return torch.empty(shape, device=like.device, dtype=like.dtype), G * V, V


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2        # the interpreter: few programs, each walking many row blocks


def gated_rms_norm(
    x: torch.Tensor,
    gate: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    eps: float = 1e-6,
    activation: str = "silu",
    dgate_into: Optional[Callable[[], torch.Tensor]] = None,
) -> torch.Tensor:
    """Fused ``rmsnorm(x) * weight * act(gate)`` over the last axis (float32 math, x's dtype out).

    Args:
        x: ``[..., V]`` rows to normalise.
        gate: ``[..., V]`` like x (the output gate), or None for a plain RMSNorm.
        weight: ``[V]`` scale, or None.
        eps: added to the mean square.
        activation: ``"silu"`` (= ``"swish"``) or ``"sigmoid"`` on the gate.
        dgate_into: called in the backward, returns the tensor (gate's shape, last axis contiguous,
            e.g. a head slice of a fused projection's gradient) the gate's gradient is written into in
            place; None (or a tensor that does not fit): a new one.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension [..., V]")
    V = x.shape[-1]
    if gate is not None:
        if not isinstance(gate, torch.Tensor) or not gate.is_floating_point():
            raise TypeError("gate: expected a floating-point torch.Tensor or None")
        if gate.shape != x.shape:
            raise ValueError(f"gate: expected the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
        if gate.device != x.device:
            raise ValueError(f"gate: on {gate.device}, expected the device of x ({x.device})")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError("weight: expected a floating-point torch.Tensor or None")
        if tuple(weight.shape) != (V,):
            raise ValueError(f"weight: expected shape ({V},) ([V], the last axis of x), got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight: on {weight.device}, expected the device of x ({x.device})")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    if V > 8192:
        raise ValueError(f"x: row width V={V} above 8192 (one row per tile)")
    check_backend(x)
    return _GatedRMSNormFunction.apply(x, gate, weight, float(eps), _ACTIVATIONS[activation], dgate_into)


def gated_rms_norm_reference(x, gate, weight, eps=1e-6, activation="silu"):
    """The same norm in plain torch at ``x``'s precision (float32 math for half inputs): a test oracle."""
    dtype = x.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    xf = x.to(work)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(work)
    if gate is not None:
        zf = gate.to(work)
        y = y * (torch.nn.functional.silu(zf) if activation in ("silu", "swish") else torch.sigmoid(zf))
    return y.to(dtype)
