"""The emulated Gluon builtins: ``gl``, ``mbarrier``, ``tma``, ``async_copy``, ``warpgroup_mma``, and
``jit``'s kernels, launched program by program (see gdngen.runtime.gluon_emulator)."""
from __future__ import annotations

import inspect
import itertools
import threading
import types

import torch

from gdngen.runtime.gluon_emulator.memory import (Pointer, SharedMemory, TensorDescriptor, _Barrier, _Barriers,
                                                  _Constexpr, _Layout, _MBarrierLayout)
from gdngen.runtime.gluon_emulator.program import (SETTINGS, GluonEmulationError, _check_launch_registers,
                                                   _check_fenced, _check_overwrite, _local, _Program, _record_read,
                                                   _Thread, _thread,
                                                   _wait_until)


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
            if SETTINGS["at_issue"]:
                copy()
                bar.tx -= desc.block_type.nbytes
                if bar.tx < 0 and bar.pending == 0:
                    raise GluonEmulationError(f"an mbarrier received {-bar.tx} bytes more than expected")
                bar._complete_if_done()
            else:
                bar.copies.append((copy, desc.block_type.nbytes))
            program.cond.notify_all()

    def bulk_write(desc: TensorDescriptor, coords, smem: SharedMemory, what: str, add: bool):
        """A TMA store (or, ``add``, a reduce-add) of ``smem``: checked at issue, landing when retired."""
        _check_tile(desc, smem, f"TMA {what}")
        coords = [int(c) for c in coords]
        thread = _thread()
        with thread.program.cond:
            _check_fenced(thread, smem, f"a TMA {what}")

        def land():
            _record_read(smem)
            box = desc._box(coords)
            if box is not None and add:
                desc.view[box[0]] += smem.data[box[1]]
            elif box is not None:
                desc.view[box[0]] = smem.data[box[1]]
        thread.stores.append(land)

    def async_copy_shared_to_global(desc: TensorDescriptor, coords, smem: SharedMemory):
        bulk_write(desc, coords, smem, "store", add=False)

    def async_add(desc: TensorDescriptor, coords, smem: SharedMemory):
        """gdngen.runtime.gluon.tma_add: as a store, but added into global memory (in its dtype) when retired."""
        bulk_write(desc, coords, smem, "add", add=True)

    def store_wait(pendings):
        stores = _thread().stores
        while len(stores) > int(pendings):
            stores.pop(0)()

    tma.async_copy_global_to_shared = async_copy_global_to_shared
    tma.async_copy_shared_to_global = async_copy_shared_to_global
    tma.store_wait = store_wait
    tma.async_add = async_add
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
        if SETTINGS["at_issue"]:
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


class _Wgmma:
    """One asynchronous wgmma in flight: its shared-memory operands, read until warpgroup_mma_wait retires it."""

    def __init__(self, operands):
        self.operands = operands
        self.retired = False


class _Pending:
    """An asynchronous wgmma's accumulator before warpgroup_mma_wait retires it: it may only be the accumulator of
    the next wgmma or a ``deps`` entry; any other use raises, as the hardware would hand back garbage."""

    def __init__(self, value: torch.Tensor, wgmma: _Wgmma, thread):
        self._value, self._wgmma, self._thread = value, wgmma, thread

    def _unready(self, *args, **kwargs):
        raise GluonEmulationError("an asynchronous wgmma's result used before warpgroup_mma_wait retired it")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __neg__ = __getitem__ = _unready
    to = sum = _unready

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise GluonEmulationError("an asynchronous wgmma's result used before warpgroup_mma_wait retired it")

    @property
    def shape(self):
        return self._value.shape


def _operand(x, operands: list):
    if isinstance(x, _Pending):
        x._unready()
    if isinstance(x, SharedMemory):
        thread = _thread()
        with thread.program.cond:
            _check_fenced(thread, x, "a wgmma")
        operands.append(x)
        return x.load()                                   # (a shared operand's read is recorded)
    return x


def _retire(thread, keep: int):
    """Retires this partition's oldest wgmmas until ``keep`` are in flight: their shared operands are read until
    now, so their reads are recorded again at this clock (an arrival before this wait does not cover them)."""
    while len(thread.wgmmas) > keep:
        wgmma = thread.wgmmas.pop(0)
        wgmma.retired = True
        for operand in wgmma.operands:
            _record_read(operand)


def warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    """acc + a @ b in float32 (``use_acc`` False: a @ b), the operands as they are (16-bit, or float32 taken
    at TF32 unless ``precision`` is "ieee"). With ``is_async`` the result is pending until warpgroup_mma_wait
    retires it, and its shared operands count as read until then; otherwise it is waited for at once (with every
    wgmma before it)."""
    thread = _thread()
    operands: list = []
    a, b = _operand(a, operands), _operand(b, operands)
    if isinstance(acc, _Pending):
        if acc._thread is not thread:
            raise GluonEmulationError("a wgmma accumulating onto another partition's pending result")
        acc = acc._value
    if a.dtype != b.dtype:
        raise GluonEmulationError(f"wgmma operands of two dtypes: {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[0] or tuple(acc.shape) != (a.shape[0], b.shape[1]):
        raise GluonEmulationError(f"wgmma shapes {tuple(a.shape)} @ {tuple(b.shape)} into {tuple(acc.shape)}")
    if a.dtype == torch.float32 and precision != "ieee":
        a, b = _round_tf32(a), _round_tf32(b)
    product = torch.matmul(a.to(torch.float32), b.to(torch.float32))
    value = acc.to(torch.float32) + product if bool(use_acc) else product
    wgmma = _Wgmma(operands)
    thread.wgmmas.append(wgmma)
    if not is_async:
        _retire(thread, 0)
        return value
    return _Pending(value, wgmma, thread)


def warpgroup_mma_wait(num_outstanding=0, deps=None):
    """Retires all but the ``num_outstanding`` most recent wgmmas of this partition; returns ``deps`` with each
    retired pending result as its value (one still in flight stays pending)."""
    if deps is None:
        raise GluonEmulationError("warpgroup_mma_wait deps must be given")
    thread = _thread()
    _retire(thread, int(num_outstanding))
    deps = tuple(d._value if isinstance(d, _Pending) and d._wgmma.retired else d for d in deps)
    return deps[0] if len(deps) == 1 else deps


def fence_async_shared(cluster=False):
    thread = getattr(_local, "thread", None)
    if thread is not None:
        with thread.program.cond:
            thread.fence()


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


gl = _make_gl()
mbarrier = _make_mbarrier()
tma = _make_tma()
async_copy = _make_async_copy()
