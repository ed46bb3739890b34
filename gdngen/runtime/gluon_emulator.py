"""The generated modules' Gluon kernels, run on the CPU with torch: what tests them where there is no H200.

Triton's interpreter (TRITON_INTERPRET=1) runs ``@triton.jit`` kernels on the CPU but not Gluon ones, so the
Gluon stages (the forward and reverse state passes, the backward's chunk and wy stages) were checked only by
the GPU tier. :func:`load_module` loads a second copy of a generated module whose Gluon names
(``gl``, ``tma``, ``mbarrier``, ``async_copy``, ``warpgroup_mma``, the host's ``row_descriptor``, ...) are
this module's emulations, and whose usability checks accept CPU tensors: its public functions then run every
Gluon kernel here, program by program, the Triton kernels beside them under the interpreter.

What is emulated, and how it finds the mistakes a kernel can make:

- Register tensors are torch tensors (layouts are ignored); a wgmma is a float32 matmul of its operands as
  they are rounded (TF32 operands rounded to 10 mantissa bits).
- Shared memory is a torch buffer filled with NaN when allocated; a load reads what is there.
- A TMA load, a cp.async copy and a TMA store land *late*: a TMA load when some partition waits on its
  mbarrier, a cp.async group at the ``wait_group`` that retires it, a TMA store at the ``store_wait`` that
  retires it (reading its shared tile then). A tile read before its wait is NaN or stale; a tile rewritten
  before its store is waited for sends the new contents. Both show in the results. Under
  :func:`loads_land_at_issue` loads land at once instead, so a slot handed back to the loader before its reader
  is done with it is overwritten under that reader (as often as the threads' interleaving lets the loader in).
- An mbarrier counts arrivals and transaction bytes as the hardware does (``expect`` is an arrival with a
  byte count): a phase completes when both reach zero. Bytes past the expected count and arrivals past the
  barrier's count raise :class:`GluonEmulationError`; so does a wait no partition can ever satisfy
  (a deadlock, after ``DEADLOCK_SECONDS`` without progress).
- ``gl.warp_specialize`` runs each partition in its own thread; the waits above are real waits. It also checks
  that the launch fits the register file (all warps, padded to warpgroups, at the launch's ``maxnreg``).
- Each partition keeps a vector clock: an arrival (an ``expect``, a TMA load's issue) publishes it on the
  barrier's phase, a completed wait takes it up. Every shared-memory read is recorded with its reader's clock,
  and a write into that memory from another partition (a TMA or cp.async load's issue, a store) must come after
  it: a slot handed back before its last read raises a write-after-read race, however the threads run.

Not emulated: each partition's registers and spills, and shared memory against its limit (the results scripts
compile the Gluon kernels for sm_90 offline: ``benchmarks/results/*offline*.py``), asynchrony of wgmma (its result
is ready at issue), layouts' legality. A read before its data has landed shows as NaN or stale values (not as an error), and the
barrier clocks keep only each barrier's last completed phase.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import sys
import threading
import types
from typing import Optional

import torch

DEADLOCK_SECONDS = 20.0


class GluonEmulationError(RuntimeError):
    """A kernel did what the hardware would not do, or would hang on."""


# ---------------------------------------------------------------------------------------------- program state

# where TMA and cp.async loads land: at the wait that retires them (a read before its wait sees NaN), or
# (loads_land_at_issue) at issue (a slot reloaded before its last reader is done hands that reader the new tile)
_LANDING = {"at_issue": False}

_local = threading.local()


class _Program:
    """One program's (CTA's) shared state: the condition every barrier waits on, and an abort flag that
    wakes the other partitions when one fails."""

    def __init__(self, pid, num_warps=4, maxnreg=None):
        self.pid = pid
        self.num_warps, self.maxnreg = num_warps, maxnreg
        self.cond = threading.Condition()
        self.failed: Optional[BaseException] = None
        self.threads = 0
        # shared-memory reads: (allocation, byte range) -> {partition: its clock at its latest read}
        self.reads: dict = {}


class _Thread:
    """One partition's (thread's) own queues: cp.async groups and TMA stores, each retired in order."""

    def __init__(self, program: _Program):
        self.program = program
        self.open_group: list = []
        self.groups: list = []
        self.stores: list = []
        self.tid = program.threads
        program.threads += 1
        self.clock = {self.tid: 0}          # vector clock: what of each partition happened before this point

    def release(self) -> dict:
        """This partition's clock as an arrival publishes it; later events are after it."""
        published = dict(self.clock)
        self.clock[self.tid] += 1
        return published

    def acquire(self, published: dict):
        for tid, c in published.items():
            if self.clock.get(tid, -1) < c:
                self.clock[tid] = c

    def flush(self):
        for group in self.groups:
            for copy in group:
                copy()
        self.groups.clear()
        for store in self.stores:
            store()
        self.stores.clear()


def _thread() -> _Thread:
    current = getattr(_local, "thread", None)
    if current is None:
        raise GluonEmulationError("a Gluon builtin called outside an emulated launch")
    return current


# ---------------------------------------------------------------------------------------------------- values

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
        self.data.copy_(value)


def _region(data: torch.Tensor):
    """A shared-memory view's allocation and byte range [lo, hi)."""
    size = data.element_size()
    lo = data.storage_offset()
    hi = lo + sum((n - 1) * stride for n, stride in zip(data.shape, data.stride()) if n > 0) + 1
    return data.untyped_storage().data_ptr(), lo * size, hi * size


def _record_read(smem: "SharedMemory"):
    """A partition read ``smem``: its clock now, for the overwrite check."""
    thread = getattr(_local, "thread", None)
    if thread is None:
        return
    key, lo, hi = _region(smem.data)
    with thread.program.cond:
        thread.program.reads.setdefault(key, {}).setdefault((lo, hi), {})[thread.tid] = thread.clock[thread.tid]


def _check_overwrite(thread, smem: "SharedMemory", what: str):
    """A write into ``smem`` (a TMA or cp.async load's issue, a store) must come after every other partition's
    reads of it: after an arrival of the reader's, made once it read, that this partition has waited on."""
    key, lo, hi = _region(smem.data)
    for (lo2, hi2), readers in thread.program.reads.get(key, {}).items():
        if lo2 < hi and lo < hi2:
            for tid, clock in readers.items():
                if tid != thread.tid and thread.clock.get(tid, -1) < clock:
                    raise GluonEmulationError(
                        f"write-after-read race: {what} from partition {thread.tid} into shared memory that "
                        f"partition {tid} read with no arrival of its, made after the read, waited on first")


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


# ------------------------------------------------------------------------------------------------- gl builtins

def _tensor(x, like=None):
    if isinstance(x, torch.Tensor):
        return x
    if like is not None and isinstance(like, torch.Tensor) and like.is_floating_point():
        return torch.tensor(x, dtype=like.dtype)
    return torch.tensor(x, dtype=torch.float32 if isinstance(x, float) else torch.int32)


def _allocate_shared_memory(dtype, shape, layout=None, value=None):
    if isinstance(layout, _MBarrierLayout):
        return _Barriers(int(torch.tensor(shape).prod()))
    data = torch.empty(tuple(int(s) for s in shape), dtype=dtype)
    if data.is_floating_point():
        data.fill_(float("nan"))
    else:
        data.fill_(torch.iinfo(dtype).max)
    memory = SharedMemory(data, layout)
    if value is not None:
        memory.store(value)
    return memory


def _load(pointer: Pointer, mask=None, other=None, **_):
    offset, mask = pointer._index(mask)
    values = pointer.base[offset]
    if mask is not None:
        values = torch.where(mask, values, torch.as_tensor(0 if other is None else other, dtype=values.dtype))
    return values


def _store(pointer: Pointer, value, mask=None, **_):
    offset, mask = pointer._index(mask)
    value = torch.as_tensor(value).to(pointer.base.dtype).expand(offset.shape)
    if mask is not None:
        offset, value = offset[mask], value[mask]
    pointer.base[offset.reshape(-1)] = value.reshape(-1)


def _where(condition, x, y):
    x_t = x if isinstance(x, torch.Tensor) else None
    y_t = y if isinstance(y, torch.Tensor) else None
    like = x_t if x_t is not None else y_t
    return torch.where(torch.as_tensor(condition), _tensor(x, like), _tensor(y, like))


def _binary(fn):
    def apply(x, y):
        like = x if isinstance(x, torch.Tensor) else y
        return fn(_tensor(x, like), _tensor(y, like))
    return apply


def _unary(fn):
    def apply(x):
        x = _tensor(x)
        return fn(x if x.is_floating_point() else x.to(torch.float32))
    return apply


def _program_id(axis):
    return torch.tensor(_thread().program.pid[int(axis)], dtype=torch.int32)


def _static_range(*args):
    return range(*(int(a) for a in args))


def _static_assert(condition, message=""):
    if not bool(condition):
        raise GluonEmulationError(f"static_assert: {message}")


REGISTER_FILE = 65536                # 32-bit registers of one Hopper SM: what one program may hold at launch


def _check_launch_registers(program: _Program, worker_num_warps):
    """A warp-specialised kernel launches all its warps at ``maxnreg`` registers a thread, the warps padded to whole
    warpgroups (setmaxnreg moves registers between warpgroups only after the launch): more than the register file
    and the kernel would not launch at all."""
    warps = program.num_warps + sum(int(w) for w in worker_num_warps)
    padded = -(-warps // 4) * 4
    if program.maxnreg is not None and int(program.maxnreg) * 32 * padded > REGISTER_FILE:
        raise GluonEmulationError(
            f"would not launch: {warps} warps (padded to {padded}) at maxnreg {program.maxnreg} need "
            f"{int(program.maxnreg) * 32 * padded} registers, the SM has {REGISTER_FILE}")


def _warp_specialize(functions_and_args, worker_num_warps, worker_num_regs=None):
    program = _thread().program
    parent = _thread()
    _check_launch_registers(program, worker_num_warps)
    results, errors = {}, []

    def run(i, fn, args):
        own = _Thread(program) if i else parent
        _local.thread = own
        try:
            with torch.no_grad():           # (grad mode is per thread)
                results[i] = fn(*args)
            own.flush()
        except BaseException as error:      # noqa: BLE001 - handed to the launch
            errors.append(error)
            with program.cond:
                program.failed = program.failed or error
                program.cond.notify_all()

    threads = [threading.Thread(target=run, args=(i, fn, args), daemon=True)
               for i, (fn, args) in enumerate(functions_and_args) if i]
    for thread in threads:
        thread.start()
    fn, args = functions_and_args[0]
    run(0, fn, args)
    _local.thread = parent
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results.get(0)


def _make_gl():
    gl = types.ModuleType("gdngen_emulated_gl")
    gl.constexpr = type("constexpr", (), {})
    gl.float32, gl.float16, gl.bfloat16 = torch.float32, torch.float16, torch.bfloat16
    gl.float64, gl.int1, gl.int32, gl.int64 = torch.float64, torch.bool, torch.int32, torch.int64
    for name in ("NVMMADistributedLayout", "DotOperandLayout", "BlockedLayout", "SliceLayout",
                 "NVMMASharedLayout", "SwizzledSharedLayout", "DistributedLinearLayout"):
        setattr(gl, name, type(name, (_Layout,), {}))
    gl.allocate_shared_memory = _allocate_shared_memory
    gl.arange = lambda start, end, layout=None: torch.arange(int(start), int(end), dtype=torch.int32)
    gl.zeros = lambda shape, dtype, layout=None: torch.zeros(tuple(int(s) for s in shape), dtype=dtype)
    gl.full = lambda shape, value, dtype, layout=None: torch.full(tuple(int(s) for s in shape), value, dtype=dtype)
    gl.load = _load
    gl.store = _store
    gl.sum = lambda x, axis=None, keep_dims=False: (x.sum() if axis is None else x.sum(int(axis), keepdim=keep_dims))
    gl.max = lambda x, axis=None, keep_dims=False: (x.max() if axis is None else x.amax(int(axis), keepdim=keep_dims))
    gl.where = _where
    gl.maximum = _binary(torch.maximum)
    gl.minimum = _binary(torch.minimum)
    for name, fn in (("exp", torch.exp), ("exp2", torch.exp2), ("log", torch.log), ("log2", torch.log2),
                     ("sqrt", torch.sqrt), ("rsqrt", torch.rsqrt), ("abs", torch.abs)):
        setattr(gl, name, _unary(fn))
    gl.convert_layout = lambda x, layout, assert_trivial=False: x
    gl.permute = lambda x, dims: x.permute(tuple(dims))
    gl.program_id = _program_id
    gl.static_range = _static_range
    gl.static_assert = _static_assert
    gl.thread_barrier = lambda: None
    gl.to_tensor = _tensor
    gl.warp_specialize = _warp_specialize
    return gl


# ------------------------------------------------------------------------------ mbarrier, TMA, cp.async, wgmma

def _wait_until(program: _Program, done, what: str):
    """Waits (the program's condition held) until ``done()``; raises on a failed partition or a deadlock."""
    while not done():
        if program.failed is not None:
            raise GluonEmulationError(f"another partition failed while this one waited on {what}")
        if not program.cond.wait(DEADLOCK_SECONDS):
            raise GluonEmulationError(f"deadlock: no progress for {DEADLOCK_SECONDS} s waiting on {what}")


def _make_mbarrier():
    mb = types.ModuleType("gdngen_emulated_mbarrier")
    mb.MBarrierLayout = _MBarrierLayout

    def init(bar: _Barrier, count):
        bar.count = bar.pending = int(count)
        bar.tx, bar.copies, bar.completed, bar.arrived, bar.last = 0, [], 0, {}, {}

    def arrive(bar: _Barrier, count=1, pred=True):
        if not bool(pred):
            return
        thread = _thread()
        program = thread.program
        with program.cond:
            bar._check_init()
            if bar.pending - int(count) < 0:
                raise GluonEmulationError(f"mbarrier over-arrived: {count} arrivals with {bar.pending} left")
            bar._join(thread.release())
            bar.pending -= int(count)
            bar._complete_if_done()
            program.cond.notify_all()

    def expect(bar: _Barrier, nbytes, pred=True):
        if not bool(pred):
            return
        program = _thread().program
        with program.cond:
            bar._check_init()
            bar.tx += int(nbytes)
        arrive(bar, 1)

    def wait(bar: _Barrier, phase, pred=True, deps=()):
        if not bool(pred):
            return
        program = _thread().program
        parity = int(phase) & 1
        with program.cond:
            bar._check_init()

            def done():
                # the loads it is waiting for land now (what a read before this wait would have missed)
                while bar.copies and (bar.completed & 1) == parity:
                    copy, nbytes = bar.copies.pop(0)
                    copy()
                    bar.tx -= nbytes
                    if bar.tx < 0:
                        raise GluonEmulationError(f"an mbarrier received {-bar.tx} bytes more than expected")
                    bar._complete_if_done()
                return (bar.completed & 1) != parity
            _wait_until(program, done, f"an mbarrier (phase parity {parity})")
            if bar.completed:
                _thread().acquire(bar.last)
            program.cond.notify_all()

    mb.init, mb.arrive, mb.expect, mb.wait = init, arrive, expect, wait
    mb.invalidate = lambda bar: None
    return mb


def _check_tile(desc: TensorDescriptor, smem: SharedMemory, what: str):
    if smem.dtype != desc.dtype or list(smem.shape) != desc.block_type.shape:
        raise GluonEmulationError(f"{what}: a {smem.dtype} {smem.shape} tile for a {desc.dtype} "
                                  f"{desc.block_type.shape} block")


def _make_tma():
    tma = types.ModuleType("gdngen_emulated_tma")

    def async_copy_global_to_shared(desc: TensorDescriptor, coords, bar: _Barrier, smem: SharedMemory, pred=True):
        if not bool(pred):
            return
        _check_tile(desc, smem, "TMA load")
        coords = [int(c) for c in coords]

        def copy():
            block = torch.zeros(desc.block_type.shape, dtype=desc.dtype)
            box = desc._box(coords)
            if box is not None:
                block[box[1]] = desc.view[box[0]]
            smem.data.copy_(block)
        thread = _thread()
        program = thread.program
        with program.cond:
            bar._check_init()
            _check_overwrite(thread, smem, "a TMA load")
            bar._join(thread.release())
            if _LANDING["at_issue"]:
                copy()
                bar.tx -= desc.block_type.nbytes
                if bar.tx < 0 and bar.pending == 0:
                    raise GluonEmulationError(f"an mbarrier received {-bar.tx} bytes more than expected")
                bar._complete_if_done()
            else:
                bar.copies.append((copy, desc.block_type.nbytes))
            program.cond.notify_all()

    def async_copy_shared_to_global(desc: TensorDescriptor, coords, smem: SharedMemory):
        _check_tile(desc, smem, "TMA store")
        coords = [int(c) for c in coords]

        def store():
            _record_read(smem)
            box = desc._box(coords)
            if box is not None:
                desc.view[box[0]] = smem.data[box[1]]
        _thread().stores.append(store)

    def store_wait(pendings):
        stores = _thread().stores
        while len(stores) > int(pendings):
            stores.pop(0)()

    tma.async_copy_global_to_shared = async_copy_global_to_shared
    tma.async_copy_shared_to_global = async_copy_shared_to_global
    tma.store_wait = store_wait
    return tma


def _make_async_copy():
    ac = types.ModuleType("gdngen_emulated_async_copy")

    def async_copy_global_to_shared(smem: SharedMemory, pointer: Pointer, mask=None, cache_modifier="",
                                    eviction_policy="", volatile=False):
        offset, mask = pointer._index(mask)
        if tuple(offset.shape) != tuple(smem.shape):
            raise GluonEmulationError(f"cp.async of {tuple(offset.shape)} pointers into a {smem.shape} tile")
        if pointer.base.dtype != smem.dtype:
            raise GluonEmulationError(f"cp.async of {pointer.base.dtype} into {smem.dtype} shared memory")

        def copy():
            values = pointer.base[offset]
            smem.data.copy_(values if mask is None else torch.where(mask, values, smem.data))
        thread = _thread()
        with thread.program.cond:
            _check_overwrite(thread, smem, "a cp.async load")
        if _LANDING["at_issue"]:
            copy()
        else:
            thread.open_group.append(copy)

    def commit_group():
        thread = _thread()
        thread.groups.append(thread.open_group)
        thread.open_group = []

    def wait_group(num_outstanding=0):
        groups = _thread().groups
        while len(groups) > int(num_outstanding):
            for copy in groups.pop(0):
                copy()

    ac.async_copy_global_to_shared = async_copy_global_to_shared
    ac.commit_group, ac.wait_group = commit_group, wait_group
    return ac


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to TF32 (10 mantissa bits, to nearest, ties away from zero: cvt.rna.tf32.f32)."""
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0x1000) & ~0x1FFF
    return bits.view(torch.float32)


def _operand(x):
    return x.load() if isinstance(x, SharedMemory) else x      # (a shared operand's read is recorded)


def warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    """acc + a @ b in float32 (``use_acc`` False: a @ b), the operands as they are (16-bit, or float32 taken
    at TF32 unless ``precision`` is "ieee")."""
    a, b = _operand(a), _operand(b)
    if a.dtype != b.dtype:
        raise GluonEmulationError(f"wgmma operands of two dtypes: {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[0] or tuple(acc.shape) != (a.shape[0], b.shape[1]):
        raise GluonEmulationError(f"wgmma shapes {tuple(a.shape)} @ {tuple(b.shape)} into {tuple(acc.shape)}")
    if a.dtype == torch.float32 and precision != "ieee":
        a, b = _round_tf32(a), _round_tf32(b)
    product = torch.matmul(a.to(torch.float32), b.to(torch.float32))
    return acc.to(torch.float32) + product if bool(use_acc) else product


def warpgroup_mma_wait(num_outstanding=0, deps=None):
    if deps is None:
        raise GluonEmulationError("warpgroup_mma_wait deps must be given")
    deps = tuple(deps)
    return deps[0] if len(deps) == 1 else deps


def fence_async_shared(cluster=False):
    return None


# ------------------------------------------------------------------------------------------------- launching

class EmulatedKernel:
    """A ``@gluon.jit`` function: called from a kernel, it runs as Python; ``kernel[grid](*args, **kwargs)``
    runs every program of the grid in turn (each with its partitions in threads)."""

    def __init__(self, fn):
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.constexprs = {name for name, p in self.signature.parameters.items()
                           if "constexpr" in str(p.annotation)}
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _argument(self, name, value):
        if name in self.constexprs:
            return _Constexpr(value) if isinstance(value, str) else value
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                raise GluonEmulationError(f"argument {name}: the emulator runs on CPU tensors only")
            return Pointer.of(value)
        if isinstance(value, bool):
            return torch.tensor(value)
        if isinstance(value, int):
            return torch.tensor(value, dtype=torch.int32 if -2**31 <= value < 2**31 else torch.int64)
        if isinstance(value, float):
            return torch.tensor(value, dtype=torch.float32)
        return value

    def launch(self, grid, args, kwargs):
        maxnreg = kwargs.get("maxnreg")
        kwargs = {k: v for k, v in kwargs.items() if k in self.signature.parameters}   # maxnreg, num_stages ...
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {name: self._argument(name, value) for name, value in bound.arguments.items()}
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,))) + (1, 1)
        previous = getattr(_local, "thread", None)
        try:
            for pid in itertools.product(*(range(g) for g in grid[:3])):
                thread = _local.thread = _Thread(_Program(pid, int(arguments.get("num_warps", 4)), maxnreg))
                with torch.no_grad():
                    self.fn(**arguments)
                if thread.open_group:
                    raise GluonEmulationError("cp.async copies never committed")
                thread.flush()
        finally:
            _local.thread = previous


def jit(fn):
    return EmulatedKernel(fn)


# ------------------------------------------------------------------------------------------- the module's view

gl = _make_gl()
mbarrier = _make_mbarrier()
tma = _make_tma()
async_copy = _make_async_copy()


def _row_descriptor(x: torch.Tensor, columns: int, block: list) -> TensorDescriptor:
    """gdngen.runtime.gluon.row_descriptor's view, built each call (an emulated descriptor holds its tensor,
    so the memo's base swap does not apply)."""
    return TensorDescriptor(x, [x.numel() // columns, columns], [columns, 1], list(block))


def runtime_module() -> types.ModuleType:
    """A copy of gdngen.runtime.gluon whose Gluon names are this module's and whose device check accepts the
    CPU (its overrides are the real module's: one ``_OVERRIDES``)."""
    spec = importlib.util.find_spec("gdngen.runtime.gluon")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.gluon = None
    module.gl, module.mbarrier, module.tma, module.async_copy = gl, mbarrier, tma, async_copy
    module.warpgroup_mma, module.warpgroup_mma_wait = warpgroup_mma, warpgroup_mma_wait
    module.fence_async_shared = fence_async_shared
    module.TensorDescriptor = TensorDescriptor
    module.AVAILABLE = True
    module.jit = jit
    module.row_descriptor = _row_descriptor
    module._device_unusable = lambda x: None if not x.is_cuda else "emulated Gluon: CPU tensors only"
    module.gl_dtype = _gl_dtype
    return module


def _gl_dtype(dtype: torch.dtype):
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"score_dtype: float16 or bfloat16, not {dtype}")
    return dtype


_LOADED: dict = {}
EMULATED_OP_NAMESPACE = "gdngen_gluon_emulated"     # the emulated copies' torch.library ops


def load_module(name: str) -> types.ModuleType:
    """``generated.<name>`` loaded again (once per process) with its Gluon kernels emulated: its public functions
    take CPU tensors through the Gluon stages wherever the real module would take CUDA ones through them (the
    same ``override`` switches turn them off). Needs TRITON_INTERPRET=1 for its Triton kernels."""
    if name in _LOADED:
        return _LOADED[name]
    spec = importlib.util.find_spec(f"generated.{name}")
    if spec is None:
        raise ValueError(f"name: no generated module generated.{name}")
    module = types.ModuleType(f"generated.{name}__gluon_emulated")
    module.__file__ = spec.origin
    code = compile(spec.loader.get_source(spec.name), spec.origin, "exec")
    real = sys.modules.get("gdngen.runtime.gluon")
    sys.modules["gdngen.runtime.gluon"] = runtime_module()
    sys.modules[module.__name__] = module
    # the copy's torch.library ops under a namespace of their own: defined as gdngen::..., they would replace the
    # real module's (torch.ops.gdngen.* would then run the emulated copy)
    custom_op = torch.library.custom_op

    def own_namespace(name, fn=None, /, **kwargs):
        name = name.replace("gdngen::", f"{EMULATED_OP_NAMESPACE}::", 1)
        return custom_op(name, **kwargs) if fn is None else custom_op(name, fn, **kwargs)
    torch.library.custom_op = own_namespace
    try:
        exec(code, module.__dict__)
    finally:
        torch.library.custom_op = custom_op
        if real is not None:
            sys.modules["gdngen.runtime.gluon"] = real
        else:
            del sys.modules["gdngen.runtime.gluon"]
    _LOADED[name] = module
    return module


@contextlib.contextmanager
def loads_land_at_issue():
    """Within the block, TMA and cp.async loads land when they are issued, and threads switch every 10 us: a
    partition that hands a slot back (arrives on its free barrier) before it has finished reading it then reads
    the next chunk's tile whenever the loader gets in first. The default (loads landing at their wait) finds
    reads before a wait instead; a test runs a kernel both ways."""
    before, interval = _LANDING["at_issue"], sys.getswitchinterval()
    _LANDING["at_issue"] = True
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        _LANDING["at_issue"] = before
        sys.setswitchinterval(interval)


@contextlib.contextmanager
def deadlock_after(seconds: float):
    """Within the block, a wait without progress for ``seconds`` raises (tests of the emulator itself)."""
    global DEADLOCK_SECONDS
    before, DEADLOCK_SECONDS = DEADLOCK_SECONDS, seconds
    try:
        yield
    finally:
        DEADLOCK_SECONDS = before
