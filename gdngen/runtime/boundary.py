"""Hooks at the one serial point of a chunk op's forward and backward: its state passes.

Everything a chunk op does is chunk-parallel except the state pass, which carries the state from
chunk to chunk (forward) or the state's gradient back (backward). A caller that splits one sequence
over devices and runs the pieces one after another (:mod:`gdngen.parallel.pipeline`) needs the
op to stop right there: the stages before the pass do not depend on the piece's start state, so
they run while the previous piece is still in its pass; only the pass waits for the state.

The generated modules call :func:`active` just before each state pass and, when a
:class:`Boundary` is set (:func:`boundary`), hand it the pass's inputs and outputs:

- forward: ``start_state(initial_state) -> initial_state`` before the pass (the hook may return
  another tensor, e.g. the previous piece's end state received from its device), then
  ``end_state(final_state)`` once the pass is launched (e.g. send it on);
- backward: ``end_grad(dht) -> dht`` before the reverse pass, then ``start_grad(dh0)``;
- and where the results go: ``output_buffer(shape, dtype, device)`` may give the forward's output
  tensor, ``gradient_buffers(q=, k=, ...)`` the backward's ``out`` tensors (``dq``, ``dk``, ``dv``,
  ``dg``, ``dbeta``, shaped like the inputs), e.g. views of one larger tensor the pieces fill, so
  no copy joins them afterwards.

Hooks are off while :mod:`gdngen.runtime.precompile` records a dry run of the op (no kernel runs
then, so nothing may be exchanged), and one op call's backward runs as one call, not in time
segments, while a boundary is set (the hooks see the whole piece's end-state gradient once).

The setting is process-wide, not per thread: autograd runs a CUDA backward on its own device
thread, and the hooks must reach it there. One boundary at a time per process.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from torch import Tensor

_STATE = {"hooks": None, "paused": False}


class Boundary:
    """What a chunk op does at its state passes; the default changes nothing."""

    def start_state(self, initial_state: Optional[Tensor]) -> Optional[Tensor]:
        return initial_state

    def end_state(self, final_state: Optional[Tensor]) -> None:
        pass

    def end_grad(self, dht: Optional[Tensor]) -> Optional[Tensor]:
        return dht

    def start_grad(self, dh0: Optional[Tensor]) -> None:
        pass

    def output_buffer(self, shape: tuple, dtype, device) -> Optional[Tensor]:
        return None

    def gradient_buffers(self, **inputs) -> dict:
        return {}


@contextmanager
def boundary(hooks: Boundary):
    """Within the block, chunk-op calls consult ``hooks`` at their state passes."""
    if not isinstance(hooks, Boundary):
        raise TypeError(f"hooks: expected a gdngen.runtime.boundary.Boundary, got {type(hooks).__name__}")
    previous = _STATE["hooks"]
    _STATE["hooks"] = hooks
    try:
        yield hooks
    finally:
        _STATE["hooks"] = previous


@contextmanager
def paused():
    """Within the block no hooks fire (a recorded dry run of the op)."""
    previous = _STATE["paused"]
    _STATE["paused"] = True
    try:
        yield
    finally:
        _STATE["paused"] = previous


def active() -> Optional[Boundary]:
    """The hooks set, or None (none set, or paused)."""
    return None if _STATE["paused"] else _STATE["hooks"]


__all__ = ["Boundary", "active", "boundary", "paused"]
