"""Serving helpers around the generated ``fused_recurrent_<name>`` functions.

A serving engine keeps one recurrent state ``[HV, K, V]`` per live request in a pool and advances a
batch of requests by a token (decode) or checks a few draft tokens (speculative decoding) per step:

* :class:`StatePool` owns the pool ``[P, HV, K, V]`` (float32, or bfloat16 to halve its memory and
  traffic), hands out and takes back slots, and resets a slot when it is handed out, so a request
  never starts from the state a previous request left behind. Slot bookkeeping lives on the host;
  resets are asynchronous device writes. Nothing here ever waits for the GPU.
* :func:`decode_step` runs one step (T >= 1 tokens per sequence) and writes each sequence's new
  state back into its slot in place.
* :func:`verify_draft` runs T draft tokens without touching the pool and keeps the state after every
  draft token; :func:`commit_accepted` then writes, for every sequence at once, the state after its
  accepted prefix into its slot. The accepted lengths stay on the device.

The per-step functions (:func:`decode_step`, :func:`verify_draft`, :func:`commit_accepted`) read no
tensor values on the host and allocate nothing but their outputs, so a step can be captured in a
CUDA graph and replayed. Build ``state_indices`` with :meth:`StatePool.indices` (checked there, on
the host list, once per batch change) into a persistent buffer; the step functions trust its values.
A slot outside the pool is skipped on the device rather than written, but two sequences naming the
same slot race: keep slots distinct (``StatePool.indices`` checks it).

Example (one decode step for a batch of three requests, the middle one padding)::

    from generated.gated_delta_rule import fused_recurrent_gated_delta_rule as gdn
    pool = StatePool(num_slots=64, num_heads=32, head_k_dim=128, head_v_dim=128, device="cuda")
    a, b = pool.allocate(), pool.allocate()
    slots = pool.indices([a, None, b])
    o = decode_step(gdn, pool, slots, q, k, v, g, beta)      # q, k: [3, 1, H, K]; v: [3, 1, HV, V]
"""
from __future__ import annotations

import heapq
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from gdngen.runtime.validate import STATE_DTYPES, trusted_values

__all__ = ["StatePool", "decode_step", "verify_draft", "commit_accepted"]

# Keywords the step helpers set themselves; passing them through **options would contradict the helper.
_RESERVED = ("initial_state", "state_indices", "inplace_final_state", "output_final_state",
             "intermediate_states", "return_intermediate_states")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def _host_index(slots: Sequence[int], device: torch.device, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An int32 index tensor on ``device`` (or written into ``out``) from a host list, without
    waiting for the device.

    A plain host-to-device copy from pageable memory makes PyTorch synchronise the stream; from
    pinned memory with ``non_blocking`` it is queued like a kernel (the caching host allocator keeps
    the pinned buffer alive until the copy has run).
    """
    if device.type != "cuda":
        host = torch.tensor(slots, dtype=torch.int32)
        return host.to(device) if out is None else out.copy_(host)
    host = torch.tensor(slots, dtype=torch.int32, pin_memory=True)
    if out is None:
        return host.to(device, non_blocking=True)
    return out.copy_(host, non_blocking=True)


class StatePool:
    """A pool of recurrent states ``[P, HV, K, V]`` with slot allocation for a serving engine.

    Args:
        num_slots: P, the most requests alive at once.
        num_heads: HV, value heads per layer (the state has one ``K x V`` matrix per value head).
        head_k_dim, head_v_dim: K and V.
        dtype: the state dtype, ``torch.float32`` (default) or ``torch.bfloat16``.  The kernels
            always accumulate in float32 registers; a bf16 pool rounds the state to bf16 once per
            step (README, serving section, has the measured error).
        device: where the pool lives.

    ``states`` is the pool tensor to pass as ``initial_state`` together with ``state_indices``.
    Slots are handed out lowest first.  Every handed-out slot is reset (zeroed, or set to the given
    initial state) before it is returned, so a reused slot never carries a previous request's state.
    Allocation and freeing are host bookkeeping plus asynchronous device writes: no host sync.  They
    are not meant to run inside a CUDA-graph capture (do admission between replays).
    """

    def __init__(self, num_slots: int, num_heads: int, head_k_dim: int, head_v_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device, None] = None):
        P = _positive_int("num_slots", num_slots)
        HV = _positive_int("num_heads", num_heads)
        K = _positive_int("head_k_dim", head_k_dim)
        V = _positive_int("head_v_dim", head_v_dim)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        if dtype not in STATE_DTYPES:
            raise TypeError(f"dtype: the state pool holds float32 or bfloat16, got {dtype}")
        self.states = torch.zeros(P, HV, K, V, dtype=dtype, device=device)
        self._free = list(range(P))            # a heap: the lowest free slot first
        self._used: set[int] = set()

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """P, the number of slots."""
        return self.states.shape[0]

    @property
    def num_free(self) -> int:
        """Slots that :meth:`allocate` can still hand out."""
        return len(self._free)

    @property
    def dtype(self) -> torch.dtype:
        """The state dtype (float32 or bfloat16)."""
        return self.states.dtype

    @property
    def device(self) -> torch.device:
        return self.states.device

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is handed out (and not freed since)."""
        return slot in self._used

    # ---- slots -------------------------------------------------------------------------------
    def allocate(self, initial_state: Optional[torch.Tensor] = None) -> int:
        """Hand out one slot, reset to zeros or to ``initial_state`` (``[HV, K, V]``, any float dtype).

        Raises ``RuntimeError`` when the pool is full.
        """
        return self.allocate_many(1, None if initial_state is None else initial_state.unsqueeze(0))[0]

    def allocate_many(self, count: int, initial_states: Optional[torch.Tensor] = None) -> list[int]:
        """Hand out ``count`` slots (lowest first), reset to zeros or to ``initial_states`` ``[count, HV, K, V]``."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TypeError(f"count: expected a non-negative int, got {count!r}")
        if count > len(self._free):
            raise RuntimeError(f"StatePool: {count} slots requested, {len(self._free)} of {self.capacity} free")
        if initial_states is not None:
            self._check_states("initial_states", initial_states, count)
        slots = [heapq.heappop(self._free) for _ in range(count)]
        self._used.update(slots)
        self.reset(slots, initial_states)
        return slots

    def free(self, slots: Union[int, Iterable[int]]) -> None:
        """Take back one slot or several.  Its state is left as is until the slot is handed out again.

        Raises ``ValueError`` for a slot that is not allocated (double free, or never handed out).
        """
        slots = [slots] if isinstance(slots, int) else list(slots)
        for slot in slots:
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise TypeError(f"slots: expected ints, got {slot!r}")
            if slot not in self._used:
                raise ValueError(f"slots: slot {slot} is not allocated (double free, or never handed out)")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: a slot is listed twice in {slots}")
        for slot in slots:
            self._used.remove(slot)
            heapq.heappush(self._free, slot)

    def reset(self, slots: Sequence[int], initial_states: Optional[torch.Tensor] = None) -> None:
        """Set the states of ``slots`` to zeros, or to ``initial_states`` ``[len(slots), HV, K, V]``.

        One asynchronous device write for all of them (an index write), no host sync.
        """
        slots = list(slots)
        for slot in slots:
            if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.capacity:
                raise ValueError(f"slots: expected slot numbers in [0, {self.capacity}), got {slot!r}")
        if not slots:
            return
        if initial_states is not None:
            self._check_states("initial_states", initial_states, len(slots))
        if len(slots) == 1:      # a view: no index tensor to move to the device
            if initial_states is None:
                self.states[slots[0]].zero_()
            else:
                self.states[slots[0]].copy_(initial_states[0])
            return
        index = _host_index(slots, self.device).long()
        if initial_states is None:
            self.states.index_fill_(0, index, 0)
        else:
            self.states.index_copy_(0, index, initial_states.to(self.dtype))

    def indices(self, slots: Sequence[Optional[int]], *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``state_indices`` tensor ``[N]`` int32 for a batch: ``slots[n]`` is sequence ``n``'s slot,
        ``None`` or ``-1`` marks padding.

        Checked here on the host list (each slot allocated, no slot twice), so the step functions can
        skip reading it back.  ``out``: an int32 device tensor ``[N]`` to write into instead of a new
        one -- keep one per batch size for CUDA-graph replay and refill it when the batch changes.
        """
        host = []
        for slot in slots:
            if slot is None or (isinstance(slot, int) and not isinstance(slot, bool) and slot == -1):
                host.append(-1)
                continue
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise TypeError(f"slots: expected ints or None, got {slot!r}")
            if slot not in self._used:
                raise ValueError(f"slots: slot {slot} is not allocated")
            host.append(slot)
        used = [s for s in host if s >= 0]
        if len(set(used)) != len(used):
            raise ValueError(f"slots: two sequences share a slot ({host}); their state writes would race")
        if out is None:
            return _host_index(host, self.device)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.int32 or tuple(out.shape) != (len(host),) or out.device != self.device:
            raise ValueError(f"out: expected an int32 tensor of shape ({len(host)},) on {self.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        return _host_index(host, self.device, out)

    def draft_buffer(self, batch: int, num_draft_tokens: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A ``[batch, num_draft_tokens, HV, K, V]`` buffer for :func:`verify_draft` (the pool's dtype by default)."""
        N = _positive_int("batch", batch)
        T = _positive_int("num_draft_tokens", num_draft_tokens)
        dtype = self.dtype if dtype is None else dtype
        if dtype not in STATE_DTYPES:
            raise TypeError(f"dtype: draft states are float32 or bfloat16, got {dtype}")
        return torch.empty(N, T, *self.states.shape[1:], dtype=dtype, device=self.device)

    def _check_states(self, name: str, states, count: int) -> None:
        if not isinstance(states, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(states).__name__}")
        if not states.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {states.dtype}")
        expected = (count, *self.states.shape[1:])
        if tuple(states.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} ([count, HV, K, V]), got {tuple(states.shape)}")
        if states.device != self.device:
            raise ValueError(f"{name}: on {states.device}, expected the pool's device ({self.device})")

    def __repr__(self) -> str:
        P, HV, K, V = self.states.shape
        return (f"StatePool(P={P}, HV={HV}, K={K}, V={V}, dtype={self.dtype}, device={self.device}, "
                f"free={self.num_free})")


# ---- per-step helpers -------------------------------------------------------------------------

def _pool_states(pool) -> torch.Tensor:
    if isinstance(pool, StatePool):
        return pool.states
    if isinstance(pool, torch.Tensor):
        return pool
    raise TypeError(f"pool: expected a StatePool or a [P, HV, K, V] tensor, got {type(pool).__name__}")


def _slots(pool, state_indices) -> torch.Tensor:
    if isinstance(state_indices, (list, tuple)):
        if not isinstance(pool, StatePool):
            raise TypeError("state_indices: a host list needs a StatePool to check it against; "
                            "pass a [N] int32 tensor for a raw pool tensor")
        return pool.indices(state_indices)
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"state_indices: expected a [N] int32/int64 tensor (or a list of slots), "
                        f"got {type(state_indices).__name__}")
    return state_indices


def _call(recurrent_fn: Callable, q, k, v, g, beta, options: dict, **fixed):
    if not callable(recurrent_fn):
        raise TypeError(f"recurrent_fn: expected a generated fused_recurrent_* function, got {recurrent_fn!r}")
    clash = sorted(set(options) & set(_RESERVED))
    if clash:
        raise TypeError(f"options: {clash} are set by the serving helper itself")
    gates = {}
    if g is not None:
        gates["g"] = g
    if beta is not None:
        gates["beta"] = beta
    # The slots were checked when they were built (StatePool.indices): no host read, no sync.
    with trusted_values():
        return recurrent_fn(q, k, v, **gates, **fixed, **options)


def decode_step(recurrent_fn: Callable, pool, state_indices, q, k, v, g=None, beta=None, **options) -> torch.Tensor:
    """Advance every sequence of a batch by its tokens and write its new state into its slot.

    Args:
        recurrent_fn: a generated ``fused_recurrent_<name>`` function.
        pool: a :class:`StatePool` or its ``[P, HV, K, V]`` states tensor (updated in place).
        state_indices: ``[N]`` int32/int64 device tensor of slots, ``-1`` = padding (from
            :meth:`StatePool.indices`); its values are not read back.  A host list of slots is
            accepted too (checked and copied to the device each call).
        q, k: ``[N, T, H, K]``; v: ``[N, T, HV, V]``; g, beta: the spec's gates (``None`` where the
            spec has none).  T = 1 is a decode step; T > 1 advances by several tokens.
        options: further keywords of ``recurrent_fn`` (``scale``, ``use_qk_l2norm_in_kernel``,
            fused-gate options, ``normalize=False`` for linear_attn, ...).

    Returns ``o`` ``[N, T, HV, V]``; rows of padding sequences are left unwritten.  Graph-safe.
    """
    states = _pool_states(pool)
    slots = _slots(pool, state_indices)
    o, _ = _call(recurrent_fn, q, k, v, g, beta, options, initial_state=states, state_indices=slots)
    return o


def verify_draft(recurrent_fn: Callable, pool, state_indices, q, k, v, g=None, beta=None, *,
                 draft_states: Optional[torch.Tensor] = None, **options):
    """Run T draft tokens per sequence from the pool's states without writing the pool.

    Same arguments as :func:`decode_step`, plus ``draft_states``: a ``[N, T_buf >= T, HV, K, V]``
    float32/bf16 buffer receiving the state after every draft token (:meth:`StatePool.draft_buffer`;
    allocated here, in the pool's dtype, when None).  The pool stays bitwise unchanged.

    Returns ``(o, draft_states)``.  Follow with :func:`commit_accepted`.  Graph-safe.
    """
    states = _pool_states(pool)
    slots = _slots(pool, state_indices)
    if draft_states is None:
        N, T = v.shape[0], v.shape[1]
        draft_states = torch.empty(N, T, *states.shape[1:], dtype=states.dtype, device=states.device)
    o, _ = _call(recurrent_fn, q, k, v, g, beta, options, initial_state=states, state_indices=slots,
                 inplace_final_state=False, intermediate_states=draft_states)
    return o, draft_states


@triton.jit
def _commit_kernel(
    pool,           # [P, E] states (E = HV * K * V), written at the committed slots
    draft,          # [N, T, E] the state after every draft token
    state_indices,  # [N] slot per sequence, -1 = padding
    num_accepted,   # [N] accepted draft tokens per sequence (0 = none)
    P,
    T,
    E,
    BLOCK: tl.constexpr,
):
    """pool[slot[n]] = draft[n, accepted[n] - 1] for every sequence with a slot and an accepted token.

    Everything is decided on the device: padding, slots outside the pool and ``accepted <= 0`` copy
    nothing; ``accepted > T`` counts as T.
    """
    i_e, i_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    accepted = tl.load(num_accepted + i_n).to(tl.int64)
    if (slot < 0) | (slot >= P) | (accepted <= 0):
        return
    accepted = tl.minimum(accepted, T)
    o_e = i_e.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_e = o_e < E
    b_s = tl.load(draft + (i_n.to(tl.int64) * T + accepted - 1) * E + o_e, mask=m_e)
    tl.store(pool + slot * E + o_e, b_s.to(pool.dtype.element_ty), mask=m_e)


def commit_accepted(pool, state_indices, draft_states: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Write the state after each sequence's accepted draft prefix into its slot: one launch, graph-safe.

    Args:
        pool: a :class:`StatePool` or its ``[P, HV, K, V]`` states tensor.
        state_indices: ``[N]`` int32/int64 slots, the ones :func:`verify_draft` ran with.
        draft_states: ``[N, T, HV, K, V]`` from :func:`verify_draft`.
        num_accepted: ``[N]`` int32/int64 device tensor, accepted draft tokens per sequence.  It is
            never read on the host: ``0`` (or less) leaves the slot as it was, values above T count
            as T, padding sequences are skipped.

    A bf16 pool gets the float32 draft states rounded once -- the same bits a decode of the accepted
    tokens would have stored.
    """
    states = _pool_states(pool)
    slots = _slots(pool, state_indices)
    if states.dim() != 4 or not states.is_contiguous() or states.dtype not in STATE_DTYPES:
        raise ValueError(f"pool: expected a contiguous float32/bf16 [P, HV, K, V] tensor, got "
                         f"{states.dtype} {tuple(states.shape)}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices: expected a [N] int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    N = slots.shape[0]
    if not isinstance(draft_states, torch.Tensor):
        raise TypeError(f"draft_states: expected a torch.Tensor, got {type(draft_states).__name__}")
    if (draft_states.dim() != 5 or draft_states.shape[0] != N or tuple(draft_states.shape[2:]) != tuple(states.shape[1:])
            or draft_states.shape[1] < 1):
        raise ValueError(f"draft_states: expected shape ({N}, T, {', '.join(map(str, states.shape[1:]))}) "
                         f"([N, T, HV, K, V]), got {tuple(draft_states.shape)}")
    if draft_states.dtype not in STATE_DTYPES or not draft_states.is_contiguous():
        raise ValueError(f"draft_states: expected a contiguous float32/bf16 tensor, got {draft_states.dtype}")
    if not isinstance(num_accepted, torch.Tensor):
        raise TypeError(f"num_accepted: expected a [N] int32/int64 device tensor, got {type(num_accepted).__name__}")
    if num_accepted.dtype not in (torch.int32, torch.int64) or tuple(num_accepted.shape) != (N,):
        raise ValueError(f"num_accepted: expected a ({N},) int32/int64 tensor, got {num_accepted.dtype} "
                         f"{tuple(num_accepted.shape)}")
    for name, x in (("state_indices", slots), ("draft_states", draft_states), ("num_accepted", num_accepted)):
        if x.device != states.device:
            raise ValueError(f"{name}: on {x.device}, expected the pool's device ({states.device})")
    E = states[0].numel()
    if N == 0 or E == 0:
        return
    if N > 65535:
        raise ValueError(f"state_indices: at most 65535 sequences per commit (a grid axis), got {N}")
    BLOCK = 1024 if states.device.type == "cuda" else 4096
    _commit_kernel[(triton.cdiv(E, BLOCK), N)](
        states, draft_states, slots, num_accepted, states.shape[0], draft_states.shape[1], E,
        BLOCK=BLOCK, num_warps=4,
    )
