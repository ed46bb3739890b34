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


def _region(data: torch.Tensor):
    """A shared-memory view's allocation and byte range [lo, hi)."""
    size = data.element_size()
    lo = data.storage_offset()
    hi = lo + sum((n - 1) * stride for n, stride in zip(data.shape, data.stride()) if n > 0) + 1
    return data.untyped_storage().data_ptr(), lo * size, hi * size


def _overlapping(accesses: dict, smem: "SharedMemory"):
    """(partition, its clock) of every recorded access to memory that ``smem`` overlaps."""
    key, lo, hi = _region(smem.data)
    for (lo2, hi2), by_partition in accesses.get(key, {}).items():
        if lo2 < hi and lo < hi2:
            yield from by_partition.items()


def _record_read(smem: "SharedMemory"):
    """A partition reads ``smem``: it must come after every other partition's writes into it (after their
    arrival, made once they wrote, that it waited on), and its clock now is kept for the overwrite check."""
    thread = getattr(_local, "thread", None)
    if thread is None:
        return
    key, lo, hi = _region(smem.data)
    with thread.program.cond:
        for tid, clock in _overlapping(thread.program.writes, smem):
            if tid != thread.tid and thread.clock.get(tid, -1) < clock:
                raise GluonEmulationError(
                    f"read-after-write race: partition {thread.tid} read shared memory that partition {tid} wrote "
                    f"with no arrival of its, made after the write, waited on first")
        thread.program.reads.setdefault(key, {}).setdefault((lo, hi), {})[thread.tid] = thread.clock[thread.tid]


def _check_overwrite(thread, smem: "SharedMemory", what: str):
    """A write into ``smem`` (a TMA or cp.async load's issue, a store) must come after every other partition's
    reads of it: after an arrival of the reader's, made once it read, that this partition has waited on. The
    write is kept for the read check. A write over an operand of this partition's own unretired wgmma raises too.

    With both checks a slot handed back early is caught whichever comes first in time: the reader's read (the
    write is not ordered before it) or the writer's write (the read is not ordered before it)."""
    for tid, clock in _overlapping(thread.program.reads, smem):
        if tid != thread.tid and thread.clock.get(tid, -1) < clock:
            raise GluonEmulationError(
                f"write-after-read race: {what} from partition {thread.tid} into shared memory that "
                f"partition {tid} read with no arrival of its, made after the read, waited on first")
    key, lo, hi = _region(smem.data)
    for wgmma in thread.wgmmas:
        for operand in wgmma.operands:
            key2, lo2, hi2 = _region(operand.data)
            if key2 == key and lo2 < hi and lo < hi2:
                raise GluonEmulationError(f"{what} into shared memory an unretired asynchronous wgmma of partition "
                                          f"{thread.tid} reads (warpgroup_mma_wait first)")
    thread.program.writes.setdefault(key, {}).setdefault((lo, hi), {})[thread.tid] = thread.clock[thread.tid]


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
