"""The emulator's program state: one program's partitions (threads), their vector clocks and the shared-memory
reads the race check weighs writes against, the settings, the error (see gdngen.runtime.gluon_emulator)."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from gdngen.runtime.gluon_emulator.memory import SharedMemory

# deadlock_seconds: a wait without progress this long raises; at_issue: TMA and cp.async loads land when issued
# (loads_land_at_issue) rather than at the wait that retires them (a read before its wait sees NaN)
SETTINGS = {"deadlock_seconds": 20.0, "at_issue": False}
REGISTER_FILE = 65536                # 32-bit registers of one Hopper SM: what one program may hold at launch


class GluonEmulationError(RuntimeError):
    """A kernel did what the hardware would not do, or would hang on."""


_local = threading.local()          # the running partition's _Thread


class _Program:
    """One program's (CTA's) shared state: the condition every barrier waits on, and an abort flag that
    wakes the other partitions when one fails."""

    def __init__(self, pid, num_warps=4, maxnreg=None):
        self.pid = pid
        self.num_warps, self.maxnreg = num_warps, maxnreg
        self.cond = threading.Condition()
        self.failed: Optional[BaseException] = None
        self.threads = 0
        # shared-memory reads and writes: (allocation, byte range) -> {partition: its clock at its latest one}
        self.reads: dict = {}
        self.writes: dict = {}
        # generic-proxy stores handed on by an arrival before a fence_async_shared: [writer, region, the clock the
        # arrival published, the writer's clock at its next fence or None]
        self.unfenced: list = []


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
        self.wgmmas: list = []              # asynchronous wgmmas not yet retired, in issue order
        self.stored: list = []              # regions of this partition's stores since its last fence_async_shared

    def release(self) -> dict:
        """This partition's clock as an arrival publishes it; later events are after it. Stores not yet fenced go
        out with it, marked as such."""
        published = dict(self.clock)
        for region in self.stored:
            self.program.unfenced.append([self.tid, region, published[self.tid], None])
        self.clock[self.tid] += 1
        return published

    def fence(self):
        """fence_async_shared: this partition's stores so far are visible to the async proxy (wgmma, TMA)."""
        self.stored.clear()
        for entry in self.program.unfenced:
            if entry[0] == self.tid and entry[3] is None:
                entry[3] = self.clock[self.tid]

    def acquire(self, published: dict):
        for tid, c in published.items():
            if self.clock.get(tid, -1) < c:
                self.clock[tid] = c

    def flush(self):
        if self.wgmmas:
            raise GluonEmulationError(f"{len(self.wgmmas)} asynchronous wgmma(s) never retired by warpgroup_mma_wait")
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


_BYTES: dict = {}                  # a view's layout -> the byte offsets it covers (the exact test's)


class _Region:
    """The bytes of one shared-memory view: its allocation, the span [lo, hi) and, for the exact test, its layout
    with the dimensions in stride order (a permuted view covers the same bytes; two column halves of one tile
    share a span but no byte)."""
    __slots__ = ("key", "lo", "hi", "view")

    def __init__(self, data: torch.Tensor):
        size = data.element_size()
        lo = data.storage_offset()
        hi = lo + sum((n - 1) * stride for n, stride in zip(data.shape, data.stride()) if n > 0) + 1
        self.key, self.lo, self.hi = data.untyped_storage().data_ptr(), lo * size, hi * size
        dims = tuple(sorted(((stride, n) for n, stride in zip(data.shape, data.stride()) if n > 1), reverse=True))
        self.view = (lo, dims, size)

    def bytes(self) -> torch.Tensor:
        covered = _BYTES.get(self.view)
        if covered is None:
            offset, dims, size = self.view
            first = torch.as_strided(torch.arange(self.hi // size + 1, dtype=torch.int64),
                                     [n for _, n in dims], [stride for stride, _ in dims], offset)
            covered = _BYTES[self.view] = (first.reshape(-1, 1) * size + torch.arange(size)).reshape(-1)
        return covered

    def overlaps(self, other: "_Region") -> bool:
        if self.key != other.key or not (self.lo < other.hi and other.lo < self.hi):
            return False
        if self.view == other.view:
            return True
        (lo1, dims1, size1), (lo2, dims2, size2) = self.view, other.view
        strides = [stride for stride, _ in dims1]
        if size1 == size2 and len(dims1) == 2 and strides == [stride for stride, _ in dims2] and strides[1] == 1:
            # two boxes of one row-major tile: rows and columns must both meet
            (row1, col1), (row2, col2) = divmod(lo1, strides[0]), divmod(lo2, strides[0])
            (_, rows1), (_, cols1) = dims1
            (_, rows2), (_, cols2) = dims2
            if col1 + cols1 <= strides[0] and col2 + cols2 <= strides[0]:
                return row1 < row2 + rows2 and row2 < row1 + rows1 and col1 < col2 + cols2 and col2 < col1 + cols1
        return bool(torch.isin(self.bytes(), other.bytes()).any())


def _overlapping(accesses: dict, region: _Region):
    """(partition, its clock) of every recorded access to memory that ``region`` overlaps."""
    for other, by_partition in accesses.get(region.key, {}).items():
        if region.overlaps(other):
            yield from by_partition.items()


def _record(accesses: dict, region: _Region, thread):
    """Keeps ``thread``'s clock as its latest access to ``region`` (one record per view)."""
    views = accesses.setdefault(region.key, {})
    same = next((r for r in views if r.view == region.view), region)
    views.setdefault(same, {})[thread.tid] = thread.clock[thread.tid]


def _record_read(smem: "SharedMemory"):
    """A partition reads ``smem``: it must come after every other partition's writes into it (after their
    arrival, made once they wrote, that it waited on), and its clock now is kept for the overwrite check."""
    thread = getattr(_local, "thread", None)
    if thread is None:
        return
    region = _Region(smem.data)
    with thread.program.cond:
        for tid, clock in _overlapping(thread.program.writes, region):
            if tid != thread.tid and thread.clock.get(tid, -1) < clock:
                raise GluonEmulationError(
                    f"read-after-write race: partition {thread.tid} read shared memory that partition {tid} wrote "
                    f"with no arrival of its, made after the write, waited on first")
        _record(thread.program.reads, region, thread)


def _check_overwrite(thread, smem: "SharedMemory", what: str):
    """A write into ``smem`` (a TMA or cp.async load's issue, a store) must come after every other partition's
    reads of it: after an arrival of the reader's, made once it read, that this partition has waited on. The
    write is kept for the read check. A write over an operand of this partition's own unretired wgmma raises too.

    With both checks a slot handed back early is caught whichever comes first in time: the reader's read (the
    write is not ordered before it) or the writer's write (the read is not ordered before it)."""
    region = _Region(smem.data)
    for tid, clock in _overlapping(thread.program.reads, region):
        if tid != thread.tid and thread.clock.get(tid, -1) < clock:
            raise GluonEmulationError(
                f"write-after-read race: {what} from partition {thread.tid} into shared memory that "
                f"partition {tid} read with no arrival of its, made after the read, waited on first")
    for wgmma in thread.wgmmas:
        if any(region.overlaps(_Region(operand.data)) for operand in wgmma.operands):
            raise GluonEmulationError(f"{what} into shared memory an unretired asynchronous wgmma of partition "
                                      f"{thread.tid} reads (warpgroup_mma_wait first)")
    _record(thread.program.writes, region, thread)


def _note_store(thread, smem: "SharedMemory"):
    """A generic-proxy store into ``smem``: the async proxy may read it only after a fence_async_shared."""
    thread.stored.append(_Region(smem.data))


def _check_fenced(thread, smem: "SharedMemory", what: str):
    """The async proxy (``what``: a wgmma's operand, a TMA store's source) reads ``smem``: no generic store into it
    may be unfenced, this partition's since its last fence, another's since the fence before the arrival this
    partition acquired it by."""
    region = _Region(smem.data)
    if any(region.overlaps(stored) for stored in thread.stored):
        raise GluonEmulationError(f"{what} reads shared memory partition {thread.tid} stored to with no "
                                  f"fence_async_shared between")
    for tid, stored, published, fenced in thread.program.unfenced:
        if tid != thread.tid and region.overlaps(stored):
            seen = thread.clock.get(tid, -1)
            if seen >= published and (fenced is None or seen < fenced):
                raise GluonEmulationError(f"{what} in partition {thread.tid} reads shared memory partition {tid} "
                                          f"stored to and handed on with no fence_async_shared before its arrival")


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


def _wait_until(program: _Program, done, what: str):
    """Waits (the program's condition held) until ``done()``; raises on a failed partition or a deadlock."""
    while not done():
        if program.failed is not None:
            raise GluonEmulationError(f"another partition failed while this one waited on {what}")
        if not program.cond.wait(SETTINGS["deadlock_seconds"]):
            raise GluonEmulationError(f"deadlock: no progress for {SETTINGS['deadlock_seconds']} s waiting on {what}")
