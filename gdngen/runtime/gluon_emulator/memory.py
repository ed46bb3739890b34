"""The emulator's values: layouts (ignored), constexprs, pointers, host-built TMA descriptors, shared memory and
mbarriers (see gdngen.runtime.gluon_emulator)."""
from __future__ import annotations

import torch

from gdngen.runtime.gluon_emulator.program import (GluonEmulationError, _check_overwrite, _local, _note_store,
                                                   _record_read)


class _Layout:
    """Every layout: accepted and ignored (register tensors are whole torch tensors)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _MBarrierLayout(_Layout):
    pass


class _Constexpr:
    """A non-numeric constexpr argument (a string: the dots' precision): ``.value`` as in Gluon."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return self.value == getattr(other, "value", other)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"constexpr({self.value!r})"


class _PointerType:
    def __init__(self, element_ty):
        self.element_ty = element_ty


class Pointer:
    """A kernel's pointer argument and the offsets added to it: ``base`` is the argument's memory from its first
    element on, as one flat tensor (Triton's pointers address elements from the data pointer, whatever the
    strides)."""

    def __init__(self, base: torch.Tensor, offset=0):
        self.base, self.offset = base, offset

    @classmethod
    def of(cls, x: torch.Tensor) -> "Pointer":
        size = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
        return cls(torch.as_strided(x, (size,), (1,), x.storage_offset()))

    @property
    def dtype(self):
        return _PointerType(self.base.dtype)

    def __add__(self, other):
        return Pointer(self.base, self.offset + other)

    __radd__ = __add__

    def __sub__(self, other):
        return Pointer(self.base, self.offset - other)

    def _index(self, mask):
        offset = torch.as_tensor(self.offset).to(torch.int64)
        if mask is not None:
            mask = torch.as_tensor(mask)
            offset, mask = torch.broadcast_tensors(offset, mask)
            offset = torch.where(mask, offset, torch.zeros_like(offset))
        if ((offset < 0) | (offset >= self.base.numel())).any():
            raise GluonEmulationError(f"an access past its argument's memory (offsets {int(offset.min())}.."
                                      f"{int(offset.max())} of {self.base.numel()})")
        return offset, mask


class _BlockType:
    def __init__(self, shape, dtype):
        self.shape = list(shape)
        self.nbytes = int(torch.tensor(self.shape).prod()) * torch.empty((), dtype=dtype).element_size()


class TensorDescriptor:
    """A host-built TMA descriptor: the [rows, columns] view of its base as the hardware sees it (row stride
    ``strides[0]`` elements from the data pointer) and its block shape."""

    def __init__(self, base: torch.Tensor, shape, strides, block_shape, layout=None):
        if strides[-1] != 1:
            raise GluonEmulationError(f"a descriptor's last stride must be 1, got {strides}")
        self.base = base
        self.view = torch.as_strided(base, tuple(shape), tuple(strides), base.storage_offset())
        self.dtype = base.dtype
        self.block_type = _BlockType(block_shape, base.dtype)
        self.layout = layout

    def _box(self, coords):
        """The block at ``coords``: (the view's slices, the block's slices) of the part inside the view (TMA
        fills the rest of a load with zeros and drops the rest of a store)."""
        view_slices, block_slices = [], []
        for c, size, extent in zip((int(c) for c in coords), self.block_type.shape, self.view.shape):
            lo, hi = max(c, 0), min(c + size, extent)
            if hi <= lo:
                return None
            view_slices.append(slice(lo, hi))
            block_slices.append(slice(lo - c, hi - c))
        return tuple(view_slices), tuple(block_slices)


class SharedMemory:
    """A shared-memory allocation or a view of one (``index``, ``permute``, ``slice``, ``_reinterpret``)."""

    def __init__(self, data: torch.Tensor, layout=None):
        self.data, self.layout = data, layout

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def shape(self):
        return list(self.data.shape)

    def index(self, i):
        return SharedMemory(self.data[int(i)], self.layout)

    def permute(self, dims):
        return SharedMemory(self.data.permute(tuple(dims)), self.layout)

    def slice(self, start, length, dim=0):
        return SharedMemory(self.data.narrow(dim, int(start), int(length)), self.layout)

    def _reinterpret(self, dtype, shape, layout):
        if not self.data.is_contiguous():
            raise GluonEmulationError("_reinterpret of a non-contiguous shared view")
        return SharedMemory(self.data.reshape(-1).view(dtype).view(tuple(shape)), layout)

    def load(self, layout=None):
        _record_read(self)
        return self.data.clone()

    def store(self, value):
        value = torch.as_tensor(value)
        if value.dtype != self.data.dtype:
            raise GluonEmulationError(f"a {value.dtype} value stored to {self.data.dtype} shared memory")
        if tuple(value.shape) != tuple(self.data.shape):
            raise GluonEmulationError(f"a {tuple(value.shape)} value stored to a {tuple(self.data.shape)} tile")
        thread = getattr(_local, "thread", None)
        if thread is not None:
            with thread.program.cond:
                _check_overwrite(thread, self, "a store")
                _note_store(thread, self)
        self.data.copy_(value)


class _Barrier:
    """One mbarrier: arrivals left and transaction bytes outstanding in the current phase, the TMA loads
    that will deliver bytes to it (landing when a partition waits on it) and the phases completed."""

    def __init__(self):
        self.count = None
        self.pending = 0
        self.tx = 0
        self.copies: list = []
        self.completed = 0
        self.arrived: dict = {}             # the current phase's arrivals' clocks, joined
        self.last: dict = {}                # the last completed phase's: what a wait on it acquires

    def _complete_if_done(self):
        if self.pending == 0 and self.tx == 0 and not self.copies:
            self.completed += 1
            self.pending = self.count
            self.last, self.arrived = self.arrived, {}

    def _join(self, published: dict):
        for tid, c in published.items():
            if self.arrived.get(tid, -1) < c:
                self.arrived[tid] = c

    def _check_init(self):
        if self.count is None:
            raise GluonEmulationError("an mbarrier used before mbarrier.init")


class _Barriers:
    def __init__(self, n):
        self.barriers = [_Barrier() for _ in range(n)]

    def index(self, i):
        return self.barriers[int(i)]
