"""Context parallelism by pipelined passes (``context_parallel(..., transfer="pipeline")``).

Each rank runs the plain op on its shard, at its normal width. Only the state passes wait: rank
``r``'s forward state pass starts from rank ``r - 1``'s end state, received point to point, and its
reverse state pass starts from rank ``r + 1``'s start-state gradient. Everything else in the op
(gates, WY, the output stage; in the backward the recompute, the intra-chunk stage and every stage
after the reverse pass) is chunk-local and overlaps the neighbours' passes. The op stops at its
state passes through :mod:`gdngen.runtime.boundary`.

With one contiguous shard per rank the state passes still run one after another, so at most the
chunk-local share of the time is split. ``pieces = n`` stripes the sequence instead: it is cut into
``n * world`` equal pieces and rank ``r`` holds pieces ``r, r + world, r + 2 world, ...``
(:func:`gdngen.parallel.shard_tokens` with ``pieces``). Each rank runs one op call per piece, in
order; while one rank runs a piece's state pass the others run the chunk-local stages of theirs,
so with a few pieces every rank stays busy and the whole op, serial passes included, is split
``world`` ways (plus one piece's chunk-local stages at the start and end). The backward runs the
pieces in reverse. A piece whose backward would hold too much memory runs as several consecutive
calls that hand the state over in memory (:func:`piece_plan`'s ``split``).

Against the widened transfer pass (:mod:`gdngen.parallel.local`): no ``K`` extra value columns
(the delta rule's transition is a dense ``K x K`` matrix, so the widened pass costs about twice
the plain one), no output correction, no second exchange; but the state passes run one rank after
another. With two ranks that is the faster trade for the delta family; the additive family's
closed-form transfer needs neither.

Communication: the crossing sequences' states, ``[rows, HV, K, V]`` float32, once per boundary
each way (sends are counted in :data:`gdngen.parallel.distributed.COMM_BYTES`), plus the final
states' all_reduce when asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from gdngen.parallel.local import _PER_TOKEN, _Layout, _fresh_initial_state, _packed_piece
from gdngen.runtime.boundary import Boundary, boundary


class _Neighbours(Boundary):
    """One piece's exchange at the op's state passes: end states to the next piece's rank, start-state
    gradients to the previous one's. Nothing here waits on the host: sends and receives make only
    the stream wait (:meth:`finish` waits for sends on CPU), and rows are picked by slices, never
    by index tensors (their host-to-device copy would block the host until the stream caught up,
    and every launch after it would then sit on the state chain's path)."""

    def __init__(self, group, piece: "_Piece", comm: dict, handoff_in: Optional["_Handoff"] = None,
                 handoff_out: Optional["_Handoff"] = None):
        global_rank = torch.distributed.get_global_rank
        self.group, self.comm = group, comm
        self.carried, self.outgoing, self.count = _rows(piece.carried), _rows(piece.outgoing), piece.layout.count
        # the neighbour call on this rank hands over in memory; another rank's, point to point
        self.handoff_in = handoff_in if piece.carried else None
        self.handoff_out = handoff_out if piece.outgoing else None
        self.prev = global_rank(group, piece.prev) if piece.carried and not piece.prev_local else None
        self.next = global_rank(group, piece.next) if piece.outgoing and not piece.next_local else None
        self.phase = "forward"
        self.start = None                # the start states the forward pass ran from
        self.pending = []                # (work, tensor) of sends in flight
        self.o_view = None               # this piece's rows of the rank's output, when B == 1
        self.grad_views = {}             # and of its gradients: "dq" -> view, ...

    def output_buffer(self, shape: tuple, dtype, device) -> Optional[Tensor]:
        view = self.o_view
        if view is not None and view.shape == shape and view.dtype == dtype and view.device == device:
            return view
        return None

    def gradient_buffers(self, **inputs) -> dict:
        found = {}
        for name, x in inputs.items():
            view = self.grad_views.get("d" + name)
            if x is not None and view is not None and view.shape == x.shape and view.dtype == x.dtype:
                found["d" + name] = view
        return found

    def _recv(self, rows: slice, like: Tensor, peer: int) -> Tensor:
        HV, K, V = like.shape[1:]
        shape = (rows.stop - rows.start, HV, K, V)
        if like.device.type != "cuda":
            buf = torch.empty(shape, device=like.device, dtype=torch.float32)
            torch.distributed.recv(buf, src=peer, group=self.group)
            return buf
        # posted from a side stream, so the receive is ready before this rank's compute stream reaches
        # it (the sender then never waits); only the compute stream waits for the data
        side = _side_stream(like.device)
        with torch.cuda.stream(side):
            buf = torch.empty(shape, device=like.device, dtype=torch.float32)
            work = torch.distributed.irecv(buf, src=peer, group=self.group)
        work.wait()
        buf.record_stream(torch.cuda.current_stream(like.device))
        return buf

    def _send(self, x: Tensor, peer: int, direction: str) -> None:
        x = x.to(torch.float32).contiguous()
        work = torch.distributed.isend(x, dst=peer, group=self.group)
        if x.is_cuda:
            # the compute stream waits for the send (tens of microseconds: the receive is posted):
            # otherwise the next stage's kernel fills the SMs and the send's kernel starts after it
            work.wait()
        self.pending.append((work, x))
        self.comm[direction] += x.numel() * x.element_size()

    def start_state(self, initial_state: Optional[Tensor]) -> Optional[Tensor]:
        if self.phase == "backward":     # a backward that recomputes the pass: the same start
            return self.start
        received = None
        if self.handoff_in is not None:
            received = self.handoff_in.state
        elif self.prev is not None:
            received = self._recv(self.carried, initial_state, self.prev)
        if received is not None:
            initial_state = initial_state.to(torch.float32, copy=True)
            initial_state[self.carried] = received
        self.start = initial_state
        return initial_state

    def end_state(self, final_state: Optional[Tensor]) -> None:
        if self.phase != "forward":
            return
        if self.handoff_out is not None:
            self.handoff_out.state = final_state[self.outgoing]
        elif self.next is not None:
            self._send(final_state[self.outgoing], self.next, "forward")

    def end_grad(self, dht: Optional[Tensor]) -> Optional[Tensor]:
        if self.handoff_out is not None:
            received = self.handoff_out.grad
        elif self.next is not None:
            received = self._recv(self.outgoing, self.start if self.start is not None else dht, self.next)
        else:
            return dht
        if dht is None or dht.numel() == 0:
            HV, K, V = received.shape[1:]
            dht = received.new_zeros(self.count, HV, K, V)
        else:
            dht = dht.to(torch.float32, copy=True)
        dht[self.outgoing] += received
        return dht

    def start_grad(self, dh0: Optional[Tensor]) -> None:
        if self.handoff_in is not None:
            self.handoff_in.grad = dh0[self.carried]
        elif self.prev is not None:
            self._send(dh0[self.carried], self.prev, "backward")

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


#: Copies made because an op call did not write into the buffers its hooks offered (the output, the
#: per-token gradients); stays 0 for the generated ops. Tests read it.
JOIN_COPIES = {"output": 0, "gradients": 0}

_SIDE_STREAMS: dict = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """The stream receives are posted from, one per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _rows(rows: list) -> slice:
    """A run of consecutive local rows as a slice (a piece carries its first sequence or all rows, and
    passes on its last sequence or all rows)."""
    if not rows:
        return slice(0, 0)
    if list(rows) != list(range(rows[0], rows[-1] + 1)):
        raise AssertionError(f"rows {rows} are not consecutive")
    return slice(rows[0], rows[-1] + 1)


@dataclass
class _Piece:
    """One op call of this rank: a contiguous piece of the sequence and how it joins its neighbours."""

    lo: int                   # its tokens in this rank's local tensors: [lo, hi)
    hi: int
    layout: _Layout           # its local sequences (dense rows, or packed)
    carried: list             # local rows whose start state is the previous piece's end state
    outgoing: list            # local rows whose end state the next piece starts from
    owned: list               # (global sequence, local row or None): final states that end here
    prev: int                 # group rank holding the previous piece
    next: int                 # group rank holding the next piece
    prev_local: bool = False  # the previous piece is this rank's call just before: handed over in memory
    next_local: bool = False


def piece_plan(B: int, T: int, rank: int, world: int, pieces: int, has_init: bool,
               offsets: Optional[list], starts: list, split=None, multiple: int = 64) -> list:
    """This rank's op calls, in sequence order. ``offsets``: the packed batch's global cu_seqlens
    (None: dense rows); ``starts``: every rank's first token (contiguous shards, ``pieces == 1``).
    ``split(length)``: how many consecutive calls a piece of ``length`` tokens runs as (memory: an
    op call's backward holds its whole piece's intermediates; default 1); the cuts fall on
    multiples of ``multiple`` (the chunk size) and the calls hand the state over in memory."""
    if pieces == 1:
        spans = [(starts[rank], starts[rank + 1])]
    else:
        if len({starts[r + 1] - starts[r] for r in range(world)}) != 1 or T % pieces:
            raise ValueError(f"pieces: {pieces} pieces per rank need equal shards whose length divides into them "
                             f"(shard lengths {[starts[r + 1] - starts[r] for r in range(world)]})")
        length = T // pieces
        spans = [(p * length, (p + 1) * length) for p in range(rank, pieces * world, world)]
    if any(end <= start for start, end in spans):
        raise ValueError(f"q: rank {rank} holds no tokens (T={T})")
    total = world * pieces
    plan, lo = [], 0
    for j, (start, end) in enumerate(spans):
        p = j * world + rank if pieces > 1 else rank           # the piece's place in the sequence
        count = max(1, min(split(end - start) if split else 1, (end - start) // multiple))
        cuts = sorted({start + (end - start) * i // count // multiple * multiple for i in range(count)} | {end})
        for a, b in zip(cuts, cuts[1:]):
            first, last = p == 0 and a == start, p == total - 1 and b == end
            if offsets is None:
                layout = _Layout(None, [(0, b - a)] * B, [not first] * B,
                                 [r if first and has_init else -1 for r in range(B)])
                outgoing = [] if last else list(range(B))
                owned = [(r, r) for r in range(B)] if last else []
            else:
                piece = _packed_piece(offsets, a, b, has_init)
                if piece.layout.count == 0:
                    raise ValueError(f"cu_seqlens: rank {rank} holds no tokens in [{a}, {b})")
                layout = piece.layout
                outgoing = [] if last or piece.ends_sequence[-1] else [layout.count - 1]
                owned = [(n, i) for i, (n, ends) in enumerate(zip(piece.seq_ids, piece.ends_sequence)) if ends]
                if first:   # an empty sequence's final state is its initial state: the first call reports it
                    owned += [(n, None) for n in range(len(offsets) - 1) if offsets[n] == offsets[n + 1]]
            carried = [i for i, c in enumerate(layout.carry) if c]
            plan.append(_Piece(lo, lo + b - a, layout, carried, outgoing, owned, (p - 1) % world, (p + 1) % world,
                               prev_local=a > start, next_local=b < end))
            lo += b - a
    return plan


class _Handoff:
    """The state (forward) and its gradient (backward) between two consecutive calls of one rank."""

    state: Optional[Tensor] = None
    grad: Optional[Tensor] = None


def pipelined_call(call, plan: list, N: int, group, names, tensors, needs_graph: bool, comm: dict, all_reduce):
    """``(o, final)`` of this rank's pieces (:func:`piece_plan`) through the op with the pipelined
    exchange. ``N``: sequences in the whole batch; ``all_reduce(x, direction)``: the group's counted
    all_reduce (final states and their gradients)."""
    return _Pipelined.apply(call, plan, N, group, names, needs_graph, comm, all_reduce, *tensors)


def _start_states(initial_state: Optional[Tensor], layout: _Layout, shape: tuple, device) -> Optional[Tensor]:
    """[L, HV, K, V] start states for the op: the user's rows for fresh sequences, 0 where carried
    (the hook puts the received states there); None when every row is fresh and no state was given."""
    fresh = _fresh_initial_state(initial_state, layout, None)
    if fresh is None and any(layout.carry):
        return torch.zeros(layout.count, *shape, dtype=torch.float32, device=device)
    return fresh


class _Pipelined(torch.autograd.Function):
    """This rank's op calls (one per piece) as one autograd node. The op's own graphs are kept and
    replayed piece by piece, last first, under each piece's hooks, so the backward's exchange happens
    inside the op's backward, at its reverse pass, in sequence order."""

    @staticmethod
    def forward(ctx, call, plan, N, group, names, needs_graph, comm, all_reduce, *tensors):
        grad_mode = torch.enable_grad if needs_graph else torch.no_grad
        leaves = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
        B, T, H, HV, K, V = call.shape
        device = call.named["q"].device
        whole = len(plan) == 1
        runs = []                          # per piece: (its op inputs, o, final, hooks)
        initial_state = dict(zip(names, leaves)).get("initial_state")
        # B == 1: every piece's output is a contiguous run of the rank's rows, written in place
        o_all = (torch.empty(B, T, HV, call.named["v"].shape[-1], device=device, dtype=call.named["v"].dtype)
                 if B == 1 and not whole else None)
        with grad_mode(), call.same_paths_as(N):
            # host-to-device copies (varlen tables, start-state rows) before the first piece runs:
            # later, each would wait for the stream to catch up
            cus = [torch.tensor(piece.layout.cu_seqlens, dtype=torch.int32, device=device)
                   if piece.layout.cu_seqlens is not None else None for piece in plan]
            starts = [_start_states(initial_state, piece.layout, (HV, K, V), device) for piece in plan]
            handoff = None
            for piece, cu, start in zip(plan, cus, starts):
                inputs = {n: (x[:, piece.lo:piece.hi] if n in _PER_TOKEN and x is not None and not whole else x)
                          for n, x in zip(names, leaves)}
                handoff_in, handoff = handoff, (_Handoff() if piece.next_local else None)
                hooks = _Neighbours(group, piece, comm, handoff_in if piece.prev_local else None, handoff)
                hooks.o_view = o_all[:, piece.lo:piece.hi] if o_all is not None else None
                with boundary(hooks):
                    o, final = call.with_args(**inputs).run(initial_state=start, output_final_state=True,
                                                            cu_seqlens=cu)
                hooks.phase = "backward"
                runs.append((inputs, o, final, hooks))
        if whole:
            o_all = runs[0][1]
        elif o_all is None or any(o.data_ptr() != hooks.o_view.data_ptr() for _, o, _, hooks in runs):
            JOIN_COPIES["output"] += o_all is not None
            o_all = torch.cat([o for _, o, _, _ in runs], dim=1)     # the op did not take the buffer

        output_final_state = bool(call.named["output_final_state"])
        if output_final_state:
            total = torch.zeros(N, HV, K, V, device=device, dtype=torch.float32)
            initial_state = call.named["initial_state"]
            for piece, (_, _, final, _) in zip(plan, runs):
                for n, row in piece.owned:
                    if row is not None:
                        total[n] = final[row].detach()
                    elif initial_state is not None:     # an empty sequence ends where it starts
                        total[n] = initial_state[n].detach().to(torch.float32)
            total = all_reduce(total, "forward")
        else:
            total = o_all.new_empty(0, dtype=torch.float32)

        if needs_graph:
            ctx.graph = (runs, leaves)
            ctx.state = (plan, names, output_final_state, all_reduce)
        else:
            for *_, hooks in runs:
                hooks.finish()
        return o_all.detach(), total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal):
        runs, leaves = ctx.graph
        plan, names, output_final_state, all_reduce = ctx.state
        if output_final_state and dfinal is not None:
            dfinal = all_reduce(dfinal.contiguous().clone(), "backward")
        wanted = [n for n, leaf in zip(names, leaves) if leaf is not None and leaf.requires_grad]
        pieces_grads = {n: [] for n in wanted}
        passed_through = []                 # empty sequences: their final state is their initial state
        # B == 1: the pieces' gradients of per-token inputs go straight into the rank's tensors
        by_name = dict(zip(names, leaves))
        full = ({n: torch.empty_like(by_name[n]) for n in wanted if n in _PER_TOKEN}
                if len(plan) > 1 and by_name["q"].shape[0] == 1 else {})
        for piece, (_, _, _, hooks) in zip(plan, runs):
            hooks.grad_views = {"d" + n: x[:, piece.lo:piece.hi] for n, x in full.items()}
        for piece, (inputs, o, final, hooks) in reversed(list(zip(plan, runs))):
            dht = torch.zeros_like(final)
            if output_final_state and dfinal is not None:
                for n, row in piece.owned:
                    if row is not None:
                        dht[row] = dfinal[n]
                    else:
                        passed_through.append((n, dfinal[n]))
            d_o = do if len(plan) == 1 else do[:, piece.lo:piece.hi]
            with boundary(hooks):
                found = torch.autograd.grad([o, final], [inputs[n] for n in wanted], [d_o, dht], allow_unused=True)
            hooks.finish()
            for n, gr in zip(wanted, found):
                view = hooks.grad_views.get("d" + n)
                if view is not None:        # normally the op wrote it there already
                    if gr is None:
                        view.zero_()
                    elif gr.data_ptr() != view.data_ptr():
                        JOIN_COPIES["gradients"] += 1
                        view.copy_(gr)
                    gr = view
                pieces_grads[n].append(torch.zeros_like(inputs[n]) if gr is None else gr)
        result = {}
        for n, parts in pieces_grads.items():
            parts = parts[::-1]             # sequence order
            if n in full:
                result[n] = full[n]
            elif n in _PER_TOKEN:
                result[n] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            else:                           # passed whole to every piece: the pieces' sum
                result[n] = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        if passed_through and "initial_state" in result:
            for n, grad in passed_through:
                result["initial_state"][n] += grad.to(result["initial_state"].dtype)
        del ctx.graph
        return (None,) * 8 + tuple(result.get(n) for n in names)
