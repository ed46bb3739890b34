"""A repeated eager op call replayed as one CUDA graph: the host time of short calls.

A generated op's call is Python: argument checks, tile look-ups, allocations and 5-10 kernel launches.
On a short call the GPU finishes before the host does. At (8, 2048, 16, 16), K = V = 128, a bf16 training
step's kernels take ~0.68 ms on the H200 and its host ~1.1 ms (benchmarks/NOTES.md, stops 40-43; the
backward's part runs on the autograd engine's thread, about 1.5x slower than the caller's). A CUDA graph
replays the same launches for ~10 us of host time.

A call is replayed when it repeats: the same op, the same tensors at the same addresses with the same
shapes, strides and dtypes, the same other arguments, stream and launch context (:func:`launch_context`).
Its first sighting runs eagerly (compiling kernels, filling every per-shape cache); the second is captured
(stream capture on a side stream, into the graph's own memory pool) and replayed; later ones replay.

A replay rewrites the tensors the capture allocated, so it runs only when nothing outside holds them any
more: each output's storage is back to the use count it had right after the capture. Otherwise the call
runs eagerly into fresh tensors, as without graphs. The caller always gets aliases (``detach()``) of the
graph's outputs, never the graph's own tensor objects, so those counts see every outside holder (a saved
tensor of autograd, a ``.grad``, a view).

Memory: a graph keeps its outputs (for the forward op: the output and what the backward keeps) and its
pool's scratch between calls, where an eager call frees them; at most :data:`CAPACITY` graphs exist,
least recently used out first. A working set of more repeated calls than that (many layers, each its own
tensors) would capture over and over, so past :data:`MAX_EVICTIONS` evictions capturing stops for the
process and the graphs are freed.

Runs eagerly, never graphed: graphs off (``GDNGEN_CUDA_GRAPHS=0``, :func:`set_enabled`); tensors not on a
CUDA device; calls doing more than :data:`MAX_WORK` (B T HV K V: the host time of longer calls is hidden
behind their kernels), or :data:`MAX_WORK_NO_GRAD` for a forward nothing differentiates; a caller that says the call is not graphable (variable-length batches: their chunk
tables come from a host sync); while the current stream is capturing (the caller's own graph takes the
launches) or torch.compile traces; while tile overrides, boundary hooks or stage recorders are active, or
launches are observed (Triton launch hooks, gdngen's compile-ahead recording: they must see each launch).
"""
from __future__ import annotations

import collections
import os
import warnings
from typing import Callable, Optional, Sequence

import torch

MAX_WORK = 1 << 33          # B * T * HV * K * V of the calls graphed: (8, 2048, 16, 16) at K = V = 128 is 2^32
# A no-grad forward runs ~5x fewer kernel-microseconds per unit of work than a training step, against the same
# ~0.3-0.6 ms of host: on the H200 the (1, 32768, 32, 32) forward's kernels take ~0.50 ms (2^34) and its host
# 0.33-0.60 ms a call, so do_bench read 0.51-0.67 ms eager against 0.51-0.54 replayed (benchmarks/NOTES.md,
# stop 52). At (1, 131072, 16, 32) (2^36) the kernels take ~2 ms: eager and replayed agree. A graph of such a
# call keeps its output and T (~0.4 GB at 2^34) between calls.
MAX_WORK_NO_GRAD = 1 << 35
CAPACITY = 8                # graphs kept, each with its own memory pool
MAX_EVICTIONS = 32          # evictions before capturing stops for the process
SIGHTINGS_KEPT = 256        # first sightings remembered (keys only)

_enabled = os.environ.get("GDNGEN_CUDA_GRAPHS", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Turn graph replay on or off for every generated op (default: on unless GDNGEN_CUDA_GRAPHS=0). Off
    frees the graphs kept."""
    global _enabled
    _enabled = bool(enabled)
    if not _enabled:
        GRAPHS.clear()


def enabled() -> bool:
    return _enabled


def launch_context():
    """What a call's launches depend on beyond its arguments, as a key part; None where a call must run
    eagerly (see the module's docstring)."""
    from gdngen.autotune import cache as _cache
    from gdngen.runtime import boundary, ops
    from gdngen.runtime.tiles import _OVERRIDES, _RECORDERS     # (gdngen.runtime.tiles is also a function's name)
    if _OVERRIDES or _RECORDERS or boundary.active() is not None:
        return None
    from gdngen.runtime.launch import launches_observed
    if launches_observed():
        return None
    return (ops.states_kept(), _cache.lookup_context(), _cache.generation())


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _call_key(args: Sequence) -> tuple:
    """The arguments as a hashable key: a tensor by its address, shape, strides and dtype; a list as a tuple;
    anything else as itself."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(_tensor_key(a))
        elif isinstance(a, list):
            parts.append(tuple(a))
        else:
            parts.append(a)
    return tuple(parts)


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage (the temporary storage object read here counts one)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Replay:
    """One captured call: its graph, its outputs (the call's structure: a tuple or list of tensors or
    None) and each output's storage use count right after the capture."""
    __slots__ = ("graph", "outputs", "kind", "uses")

    def __init__(self, graph, outputs):
        self.graph = graph
        self.kind = type(outputs)
        self.outputs = tuple(outputs)
        self.uses = tuple(None if t is None else _storage_uses(t) for t in self.outputs)

    def free(self) -> bool:
        """Whether nothing outside holds an output any more (a replay may rewrite them)."""
        for t, uses in zip(self.outputs, self.uses):
            if t is not None and _storage_uses(t) != uses:
                return False
        return True

    def handed_out(self):
        """The outputs as the caller gets them: aliases, in the call's structure."""
        return self.kind(None if t is None else t.detach() for t in self.outputs)


class CudaGraphBackend:
    """Captures and replays with torch.cuda.CUDAGraph (tests put a stand-in in its place)."""

    def __init__(self):
        self._side_streams: dict = {}

    def handles(self, x: torch.Tensor) -> bool:
        return x.is_cuda

    def stream_key(self, device: torch.device):
        return torch.cuda.current_stream(device).cuda_stream

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def capture(self, fn: Callable, args: Sequence, device: torch.device):
        """(graph, outputs) of ``fn(*args)`` captured, nothing run yet; raises what fn or the capture raised."""
        side = self._side_streams.get(device.index)
        if side is None:
            side = self._side_streams[device.index] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(current)
        with torch.cuda.device(device), torch.cuda.stream(side):
            # thread_local: the backward captures on the autograd engine's thread
            graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
            try:
                outputs = fn(*args)
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:
                    pass
                raise
            graph.capture_end()
        current.wait_stream(side)
        return graph, outputs

    def replay(self, graph, device: torch.device, args: Sequence) -> None:
        """Launch ``graph``; it reads the call's arguments ``args`` at the addresses it was captured with."""
        with torch.cuda.device(device):
            graph.replay()       # on the current stream


class GraphCache:
    """The replays kept, the calls seen once, and the counters (``captures``, ``replays``, ``eager``)."""

    def __init__(self, backend=None):
        self.backend = backend or CudaGraphBackend()
        self._replays: collections.OrderedDict = collections.OrderedDict()
        self._seen: collections.OrderedDict = collections.OrderedDict()
        self._unusable: set = set()
        self.evictions = 0
        self.stopped = False
        self.captures = self.replays = self.eager = 0

    def clear(self) -> None:
        self._replays.clear()
        self._seen.clear()
        self._unusable.clear()

    def __len__(self) -> int:
        return len(self._replays)

    def call(self, name: str, fn: Callable, args: Sequence, *, q: torch.Tensor, v: torch.Tensor,
             graphable: bool = True, no_grad: bool = False):
        """``fn(*args)``, through a replayed CUDA graph where the call repeats (see the module's docstring).
        ``q`` and ``v`` size the call's work (B T HV K V), ``graphable=False`` keeps it eager, ``no_grad`` (a
        forward nothing differentiates) bounds the work by :data:`MAX_WORK_NO_GRAD` instead of :data:`MAX_WORK`."""
        key = self._key(name, args, q, v, graphable, no_grad)
        if key is None:
            self.eager += 1
            return fn(*args)
        replay = self._replays.get(key)
        if replay is not None:
            if not replay.free():
                self.eager += 1
                return fn(*args)
            self._replays.move_to_end(key)
            self.backend.replay(replay.graph, q.device, args)
            self.replays += 1
            return replay.handed_out()
        if self.stopped or key in self._unusable or key not in self._seen:
            self._see(key)
            self.eager += 1
            return fn(*args)
        return self._capture(key, fn, args, q.device)

    def _key(self, name, args, q, v, graphable, no_grad=False) -> Optional[tuple]:
        bound = MAX_WORK_NO_GRAD if no_grad else MAX_WORK
        if not (_enabled and graphable and self.backend.handles(q)) or v.numel() * q.shape[-1] > bound:
            return None
        if self.backend.capturing() or torch.compiler.is_compiling():
            return None
        context = launch_context()
        if context is None:
            return None
        return (name, q.device.index, self.backend.stream_key(q.device), context, _call_key(args))

    def _see(self, key) -> None:
        seen = self._seen
        seen[key] = None
        seen.move_to_end(key)
        while len(seen) > SIGHTINGS_KEPT:
            seen.popitem(last=False)

    def _capture(self, key, fn, args, device):
        self._seen.pop(key, None)
        try:
            graph, outputs = self.backend.capture(fn, args, device)
        except Exception as error:
            # not capturable (a host sync, an allocation the capture refuses): eager from now on for this call
            self._unusable.add(key)
            warnings.warn(f"gdngen: {key[0]} runs eagerly, its CUDA graph capture failed: {error}", RuntimeWarning,
                          stacklevel=3)
            self.eager += 1
            return fn(*args)
        replay = _Replay(graph, outputs)
        del outputs
        self._replays[key] = replay
        self.captures += 1
        while len(self._replays) > CAPACITY:
            self._replays.popitem(last=False)
            self.evictions += 1
        if self.evictions > MAX_EVICTIONS and not self.stopped:
            # more repeated calls than graphs kept: each would be captured again and again
            self.stopped = True
            self._replays.clear()
            warnings.warn(f"gdngen: CUDA graph replay stopped after {self.evictions} evictions: more repeated calls "
                          f"than the {CAPACITY} graphs kept (gdngen.runtime.graphs.CAPACITY)", RuntimeWarning,
                          stacklevel=3)
        self.backend.replay(replay.graph, device, args)
        return replay.handed_out()


GRAPHS = GraphCache()


def replay_or_run(name: str, fn: Callable, args: Sequence, *, q: torch.Tensor, v: torch.Tensor,
                  graphable: bool = True, no_grad: bool = False):
    """``fn(*args)`` through the process's :class:`GraphCache`."""
    return GRAPHS.call(name, fn, args, q=q, v=v, graphable=graphable, no_grad=no_grad)


__all__ = ["CAPACITY", "GRAPHS", "GraphCache", "MAX_EVICTIONS", "MAX_WORK", "MAX_WORK_NO_GRAD", "enabled", "launch_context",
           "replay_or_run", "set_enabled"]
