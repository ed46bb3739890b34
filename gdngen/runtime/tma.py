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

from gdngen.runtime.launch import LAUNCH_KEY_ATTRIBUTE, descriptor_key


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


# (builder, dtype, numel, columns, block rows, block columns) -> (a validated descriptor's fields but its base,
# its launch key)
_ROW_DESCRIPTORS: dict = {}
ROW_DESCRIPTOR_MEMO = 256           # view shapes remembered before the memo starts over


def memoised_row_descriptor(x: torch.Tensor, columns: int, block: list, build):
    """``build(x, columns, block)``: a host-built TMA descriptor over contiguous ``x`` seen as rows of ``columns``
    elements ([numel / columns, columns]) in ``block`` tiles, memoised per view shape.

    Triton's constructor checks every field (~4 us on the CPU machine) and the cached launch path keys it
    (~2.4 us): 15 descriptors per backward. So the first descriptor of a view shape is built and checked there,
    and later ones of that shape copy its fields, take ``x`` as their base (what depends on the base, its dtype
    and its 16-byte alignment, is the memo's key and checked here) and carry its launch key (~1 us in all). The
    memo keeps no tensor."""
    key = (build, x.dtype, x.numel(), columns, block[0], block[1])
    known = _ROW_DESCRIPTORS.get(key)
    if known is not None and x.data_ptr() % 16 == 0:
        kind, fields, launch_key = known
        desc = object.__new__(kind)
        desc.__dict__.update(fields)
        desc.base = x
        desc.__dict__[LAUNCH_KEY_ATTRIBUTE] = launch_key
        return desc
    desc = build(x, columns, block)
    if len(_ROW_DESCRIPTORS) >= ROW_DESCRIPTOR_MEMO:
        _ROW_DESCRIPTORS.clear()
    launch_key = descriptor_key(desc)
    _ROW_DESCRIPTORS[key] = (type(desc), {**desc.__dict__, "base": None}, launch_key)
    desc.__dict__[LAUNCH_KEY_ATTRIBUTE] = launch_key
    return desc


def _triton_descriptor(x: torch.Tensor, columns: int, block: list):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(x, [x.numel() // columns, columns], [columns, 1], list(block))


def tile_descriptor(x: torch.Tensor, columns: int, block: list):
    """A host-built descriptor for a Triton kernel's ``desc.load`` (triton.tools' TensorDescriptor) over contiguous
    ``x`` seen as rows of ``columns`` elements, in ``block`` tiles; memoised per view shape like the Gluon
    kernels' (:func:`memoised_row_descriptor`). Built on the host, not in each program: a kernel of one short
    program per chunk (the forward wy stage) lost ~10 us at (4,8192,16,32) to per-program descriptors."""
    return memoised_row_descriptor(x, columns, block, _triton_descriptor)


def key_tile_config(config: dict, k: torch.Tensor, *, H: int, K: int, BT: int):
    """``(config, k_desc)`` for the forward wy stage's key tiles: where ``config`` asks for TMA, k allows it
    (:func:`tma_usable`) and BK divides K (a [BT, BK] box past a head's K would read the next head's columns), a
    host descriptor over k's [B * T, H * K] rows (:func:`tile_descriptor`); otherwise no descriptor and TMA off,
    with BK kept to 64: the pointer loads stage the tile in the one warp's registers."""
    if config.get("TMA") and K % config["BK"] == 0 and tma_usable(k, sizes=(K,)):
        return config, tile_descriptor(k, H * K, [BT, config["BK"]])
    if "TMA" in config:
        config = dict(config, TMA=False, BK=min(config["BK"], 64))
    return config, None
