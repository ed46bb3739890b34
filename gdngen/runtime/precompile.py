"""Compile a generated op's kernels in parallel before its first launch.

Triton compiles a kernel at its first launch, one kernel after another: a chunk forward launches
three to five kernels and its backward six to eight, so a user's first forward or training step
waits for every compile in turn (issue #5: first call <= 10 s). Most of a compile runs outside
Python's lock (MLIR passes, LLVM, ptxas, the C launcher's gcc), so threads overlap them well.

``compile_ahead(key, run)`` does that on the first call per ``key`` (the caller's shape class: the
values the kernels specialise on): it runs ``run`` once with every Triton launch on this thread
turned into a compile job - nothing executes, no tensor is written, the host code only allocates -
then compiles the jobs on a thread pool, one worker per kernel (a kernel's launches in order, so
no two threads compile the same kernel), loads each binary and builds its launcher, and returns.
The caller then runs for real and finds every kernel compiled. Anything that goes wrong ahead of
time is dropped: the real launch compiles again and raises the error where it belongs.

Off on the CPU interpreter, with ``GDNGEN_COMPILE_AHEAD=0``, and while torch.compile traces.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Hashable, Optional

import torch

from gdngen.runtime.boundary import paused as boundary_paused

_DONE: set = set()
_LOCK = threading.Lock()
MAX_WORKERS = 16


def enabled(x: torch.Tensor) -> bool:
    """Compile ahead for this call: a CUDA tensor, the interpreter off, not disabled, not tracing."""
    if x.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("GDNGEN_COMPILE_AHEAD", "1") == "0":
        return False
    return not torch.compiler.is_compiling()


@contextmanager
def launches_recorded():
    """Within the block, Triton launches made on this thread are recorded, not run.

    Yields an ordered dict: kernel (JITFunction) -> list of (args, kwargs) of its launches, each
    kwargs holding ``grid`` and the launch options. Launches from other threads run as usual.
    """
    from triton.runtime.jit import JITFunction
    recorded: "OrderedDict[object, list]" = OrderedDict()
    owner = threading.get_ident()
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if threading.get_ident() != owner:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        recorded.setdefault(self, []).append((args, dict(kwargs, grid=grid)))
        return None

    with _LOCK:
        JITFunction.run = run
        try:
            yield recorded
        finally:
            JITFunction.run = original


def _compile_kernel(kernel, launches: list, device: int) -> None:
    """Compile (warm up) one kernel's recorded launches on ``device``, then load each binary."""
    with torch.cuda.device(device):
        for args, kwargs in launches:
            try:
                compiled = kernel.run(*args, warmup=True, **kwargs)
                init = getattr(compiled, "_init_handles", None)
                if init is not None:
                    init()                 # load the cubin, build (gcc) or load the C launcher
            except Exception:              # noqa: BLE001 - the real launch reports it
                pass


def compile_recorded(recorded: dict, device: int, compile_kernel: Optional[Callable] = None) -> None:
    """Compile every recorded kernel, one thread per kernel, and wait for all.

    ``compile_kernel(kernel, launches, device)``: default Triton's warm-up compile and load."""
    if not recorded:
        return
    if compile_kernel is None:
        import triton
        triton.runtime.driver.active.get_current_device()     # lazy driver init once, on this thread
        for kernel in recorded:
            kernel.device_caches[device]                       # create the binder here, not in a race
        compile_kernel = _compile_kernel
    with ThreadPoolExecutor(min(MAX_WORKERS, len(recorded)), thread_name_prefix="gdngen-compile") as pool:
        for future in [pool.submit(compile_kernel, k, launches, device) for k, launches in recorded.items()]:
            future.result()


def compile_ahead(key: Hashable, run: Callable[[], object], device: int,
                  compile_kernel: Optional[Callable] = None) -> bool:
    """On the first call per ``key``: record ``run``'s launches and compile them in parallel.

    Returns True when it compiled (the first call for ``key``), False otherwise.
    """
    if key in _DONE:
        return False
    _DONE.add(key)
    try:
        with launches_recorded() as recorded, boundary_paused():     # a dry run exchanges nothing
            run()
    except Exception:                      # noqa: BLE001 - the real call raises it
        return False
    compile_recorded(recorded, device, compile_kernel)
    return True


# Keys per op before compiling ahead stops (varlen training meets a new total length every step;
# after this many shapes every kernel it launches has been compiled many times over)
KEYS_PER_OP = 64
_KEYS_SEEN: dict[str, int] = {}


def _key(op: str, tensors: tuple, options: tuple) -> tuple:
    # torch.Size hashes and compares as the tuple of its sizes
    return (op, tuple([None if t is None else (t.dtype, t.shape, t.data_ptr() % 16 == 0) for t in tensors]),
            tuple(options))


def compile_first_call(op: str, tensors: tuple, options: tuple, run: Callable[[], object]) -> bool:
    """``compile_ahead`` keyed by what Triton specialises on: each tensor's dtype, shape and 16-byte
    alignment (None for an absent one) and the op's options. ``tensors[0]`` must be a tensor.

    Returns True when it compiled ahead (a first call), False otherwise."""
    first = tensors[0]
    # every call after a shape class's first ends here, before enabled()'s environment reads
    if first.is_cuda and not torch.compiler.is_compiling() and _key(op, tensors, options) in _DONE:
        return False
    if not enabled(first):
        return False
    key = _key(op, tensors, options)
    if key in _DONE or _KEYS_SEEN.get(op, 0) >= KEYS_PER_OP:
        return False
    _KEYS_SEEN[op] = _KEYS_SEEN.get(op, 0) + 1
    return compile_ahead(key, run, first.device.index if first.device.index is not None else torch.cuda.current_device())


def forget() -> None:
    """Compile ahead again for every key (tests)."""
    _DONE.clear()
    _KEYS_SEEN.clear()


__all__ = ["KEYS_PER_OP", "compile_ahead", "compile_first_call", "compile_recorded", "enabled", "forget",
           "launches_recorded"]
