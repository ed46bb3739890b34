"""Hopper TMA loads in generated kernels: when a tile config's ``TMA`` option can be honoured, and the
global scratch the on-device descriptors need.

A kernel that builds tensor descriptors on the device (``tl.make_tensor_descriptor``) asks Triton's
launcher for a global-memory scratch area per program; Triton gets it from the allocator set with
``triton.set_allocator`` (a context variable, per thread). :func:`tma_config` sets one backed by
torch's caching allocator where none is set, so a generated call works in any thread (the first
call's compile-ahead threads included) without the user setting anything; an allocator the caller
set is kept.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def _scratch(size: int, alignment: int, stream: Optional[int]):
    # the launcher's per-launch descriptor workspace (128 bytes per descriptor and program)
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Set the scratch allocator on-device descriptors need, unless the caller set one (cheap: one read)."""
    import triton
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):     # a Triton without this layout: set ours
        pass
    triton.set_allocator(_scratch)


_CAPABLE: dict = {}     # CUDA device index -> Hopper or newer, read once per device


def _device_allows(t: torch.Tensor) -> bool:
    if t.is_cuda:
        index = t.get_device()
        capable = _CAPABLE.get(index)
        if capable is None:
            capable = _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
        return capable
    return os.environ.get("TRITON_INTERPRET") == "1"


def tma_usable(*tensors, sizes=()) -> bool:
    """Whether descriptors over ``tensors`` (row-contiguous ``[..., rows, row elements]`` tiles whose
    rows start ``sizes`` elements apart inside a token: K, V, BT) satisfy TMA's rules: 16-byte
    aligned bases and row strides. On CUDA, Hopper or newer; under TRITON_INTERPRET=1 always (the
    interpreter emulates descriptors, so the CPU tier runs the same kernel source).

    Every no-grad forward asks (the fused pass's tiles), so it is kept to a few microseconds of host
    time: the capability is read once per device, the row strides once per element size."""
    first = None
    widths = set()
    for t in tensors:
        if t is None:
            continue
        if first is None:
            first = t
        if t.data_ptr() % 16:
            return False
        widths.add(t.element_size())
    if first is None or not _device_allows(first):
        return False
    return not any(n * width % 16 for width in widths for n in sizes)


def tma_config(config: dict, *tensors, sizes=()) -> dict:
    """``config`` with ``TMA`` honoured where :func:`tma_usable` allows it (then the scratch allocator
    is ensured), or cleared where it does not; unchanged when it does not ask for TMA."""
    if not config.get("TMA"):
        return config
    if not tma_usable(*tensors, sizes=sizes):
        return dict(config, TMA=False)
    if tensors[0] is not None and tensors[0].device.type == "cuda":
        ensure_scratch_allocator()
    return config
