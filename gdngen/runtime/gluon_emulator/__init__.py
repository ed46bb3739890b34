"""The generated modules' Gluon kernels, run on the CPU with torch: what tests them where there is no H200.

Triton's interpreter (TRITON_INTERPRET=1) runs ``@triton.jit`` kernels on the CPU but not Gluon ones, so the
Gluon stages (the forward and reverse state passes, the backward's chunk and wy stages) were checked only by
the GPU tier. :func:`load_module` loads a second copy of a generated module whose Gluon names
(``gl``, ``tma``, ``mbarrier``, ``async_copy``, ``warpgroup_mma``, the host's ``row_descriptor``, ...) are
this module's emulations, and whose usability checks accept CPU tensors: its public functions then run every
Gluon kernel here, program by program, the Triton kernels beside them under the interpreter.

What is emulated, and how it finds the mistakes a kernel can make:

- Register tensors are torch tensors (layouts are ignored); a wgmma is a float32 matmul of its operands as
  they are rounded (TF32 operands rounded to 10 mantissa bits). An asynchronous wgmma's result is pending until
  ``warpgroup_mma_wait`` retires it: using it earlier raises, and so do overwriting one of its shared operands
  before then and a partition ending with one unretired; its shared operands count as read until the wait.
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
  (a deadlock, after ``SETTINGS["deadlock_seconds"]`` without progress).
- ``gl.warp_specialize`` runs each partition in its own thread; the waits above are real waits. It also checks
  that the launch fits the register file (all warps, padded to warpgroups, at the launch's ``maxnreg``).
- Each partition keeps a vector clock: an arrival (an ``expect``, a TMA load's issue) publishes it on the
  barrier's phase, a completed wait takes it up. Every shared-memory read and write (a TMA or cp.async load's
  issue, a store) is recorded with its partition's clock. A write into memory another partition read must come
  after that read, and a read of memory another partition wrote must come after that write: a slot handed back
  before its last read, or a tile read before the wait that orders it after its load, raises a race, whichever
  of the two the threads' timing puts first.
- A store into shared memory is a generic-proxy write: the async proxy (a wgmma operand, a TMA store's source)
  may read it only after a ``fence_async_shared`` of the storing partition, made before the arrival that
  handed the tile on; a read without one raises.
- Regions overlap by their bytes (two column halves of one tile do not; a permuted view is its tile).

The package: ``program`` (partitions, their clocks, the race check), ``memory`` (pointers, descriptors, shared
memory, mbarriers), ``language`` (the builtins and launches), and here the generated module's emulated view.

Not emulated: each partition's registers and spills, and shared memory against its limit
(``benchmarks/offline_sm90.py`` compiles every launch for sm_90a without a GPU), layouts' legality. The barrier
clocks keep only each barrier's last completed phase.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import torch

from gdngen.runtime.gluon_emulator.language import (EmulatedKernel, async_copy, fence_async_shared, gl, jit, mbarrier,
                                                    tma, warpgroup_mma, warpgroup_mma_wait)
from gdngen.runtime.gluon_emulator.memory import Pointer, SharedMemory, TensorDescriptor
from gdngen.runtime.gluon_emulator.program import REGISTER_FILE, SETTINGS, GluonEmulationError

__all__ = ["EMULATED_OP_NAMESPACE", "EmulatedKernel", "GluonEmulationError", "Pointer", "REGISTER_FILE",
           "SharedMemory", "TensorDescriptor", "async_copy", "deadlock_after", "fence_async_shared", "gl", "jit",
           "load_module", "loads_land_at_issue", "mbarrier", "runtime_module", "tma", "warpgroup_mma",
           "warpgroup_mma_wait"]


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
    module.tma_add = tma.async_add
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
    before, interval = SETTINGS["at_issue"], sys.getswitchinterval()
    SETTINGS["at_issue"] = True
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        SETTINGS["at_issue"] = before
        sys.setswitchinterval(interval)


@contextlib.contextmanager
def deadlock_after(seconds: float):
    """Within the block, a wait without progress for ``seconds`` raises (tests of the emulator itself)."""
    before, SETTINGS["deadlock_seconds"] = SETTINGS["deadlock_seconds"], seconds
    try:
        yield
    finally:
        SETTINGS["deadlock_seconds"] = before
