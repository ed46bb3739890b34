"""What every generated ``torch.library`` op shares: the empty-tensor stand-in for None, and the
float64 reference backward.

A custom op returns tensors only, so an absent final state or an input gradient nobody asked for
travels as an empty tensor (:func:`absent`) and the Python side maps it back to None
(:func:`present`).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad


def absent(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The stand-in for None in an op's outputs: an empty 1-D tensor on ``like``'s device."""
    return like.new_empty(0, dtype=dtype)


def present(x: torch.Tensor, wanted: bool) -> Optional[torch.Tensor]:
    """Map an op output back to the Python API: ``x`` when it was asked for, else None."""
    return x if wanted else None


def kept_gate_pair(gates: Optional[torch.Tensor], g: Optional[torch.Tensor],
                   beta: Optional[torch.Tensor]) -> Optional[tuple]:
    """The forward's kept gates as the backward's ``(g_cum, beta_act)``, or None where it kept none
    (None or an empty tensor). ``gates`` is ``[n, B, T, HV]`` float32: g_cum first where ``g`` is
    given, then the activated beta where ``beta`` is; the absent one's entry is None."""
    if gates is None or gates.numel() == 0 or (g is None and beta is None):
        return None
    return (gates[0] if g is not None else None, gates[-1] if beta is not None else None)


def needs_autograd_function(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether an eager op call over ``tensors`` must go through its ``torch.autograd.Function``: a
    backward may follow (grad mode on and some tensor requires grad), or a forward-mode AD level or a
    ``torch.func`` transform is active (apply then raises for the missing jvp or runs the transform's
    rule; dual tensors do not require grad, so without this check their tangents would be dropped
    silently). Otherwise apply would only run the forward, after binding its arguments and saving a
    context nobody reads: 40-50 us of host time per call (CPU, benchmarks/host_profile_cpu.py).
    Torch internals this cannot read count as active."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    transforms = getattr(torch._C, "_are_functorch_transforms_active", None)
    if transforms is None or transforms():
        return True
    return getattr(_forward_ad, "_current_level", 0) >= 0


def reference_grads(forward: Callable, inputs: Sequence[Optional[torch.Tensor]], needs: Sequence[bool],
                    grad_outputs: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """Gradients by replaying ``forward`` (the spec's float64 reference) under ``torch.func.vjp``.

    ``forward(*inputs)`` returns float64 ``(o, final_state or None)``; ``needs[i]`` says whether
    ``inputs[i]`` wants a gradient.  Returns one tensor per input: its gradient in the input's dtype
    (zeros when the output does not depend on it), or :func:`absent` where none is wanted.  Exact
    and deterministic, and slow; used until generated backward kernels land.  ``torch.func`` works
    inside a custom op's kernel, where the dispatcher has switched tape-based autograd off.
    """
    wanted = [i for i, need in enumerate(needs) if need]
    found: Sequence[Optional[torch.Tensor]] = [None] * len(wanted)
    if wanted:
        base = [x.detach().double() if need else x for x, need in zip(inputs, needs)]

        def replay(*leaves):
            args = list(base)
            for i, leaf in zip(wanted, leaves):
                args[i] = leaf
            o, final_state = forward(*args)
            return (o,) if final_state is None else (o, final_state)

        outputs, pullback = torch.func.vjp(replay, *[base[i] for i in wanted])
        cotangents = tuple(gr.double() if gr is not None and gr.numel() > 0 else torch.zeros_like(out)
                           for out, gr in zip(outputs, grad_outputs))
        found = pullback(cotangents)
    like = next(x for x in inputs if x is not None)
    found = iter(found)
    grads = []
    for x, need in zip(inputs, needs):
        if need:
            gr = next(found)
            grads.append(torch.zeros_like(x) if gr is None else gr.to(x.dtype))
        else:
            grads.append(absent(like))
    return grads


def fake_grads(inputs: Sequence[Optional[torch.Tensor]], needs: Sequence[bool]) -> list[torch.Tensor]:
    """Shapes and dtypes of :func:`reference_grads`' result, for the backward op's fake kernel."""
    like = next(x for x in inputs if x is not None)
    return [torch.empty_like(x) if need else absent(like) for x, need in zip(inputs, needs)]


def sum_head_groups_torch(x: torch.Tensor, H: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gdngen.runtime.head_groups.sum_head_groups`` by torch's elementwise adds of strided views, accumulated in float32
    beyond two terms (on the H200 the generic ``view(..., G, K).sum(3)`` reduction ran at about a
    third of the memory bandwidth: 0.27 ms per call at (4, 8192, 16, 32), bf16 - benchmarks/NOTES.md)."""
    B, T, HV, K = x.shape
    groups = x.view(B, T, H, HV // H, K)
    if HV // H == 2:
        if out is None:
            return torch.add(groups[:, :, :, 0], groups[:, :, :, 1])   # one rounding, as a float32 sum
        return torch.add(groups[:, :, :, 0], groups[:, :, :, 1], out=out)
    total = groups[:, :, :, 0].to(torch.float32, copy=True)     # (.float() of float32 is x itself: += wrote x)
    for i in range(1, HV // H):
        total += groups[:, :, :, i]
    if out is None:
        return total.to(x.dtype)
    return out.copy_(total)


# Whether the forward op keeps its chunk-start states for a backward. A call that nothing will
# differentiate (grad mode off, or no input requiring grad) clears it, and specs whose state pass
# can write the output itself then skip the states' and V_new's round trips through memory.
_KEEP_STATES: contextvars.ContextVar = contextvars.ContextVar("gdngen_keep_states", default=True)


@contextmanager
def keeping_states(keep: bool):
    """Inside the block the forward ops keep (True) or drop (False) what a backward would need."""
    token = _KEEP_STATES.set(bool(keep))
    try:
        yield
    finally:
        _KEEP_STATES.reset(token)


def states_kept() -> bool:
    return _KEEP_STATES.get()
