"""Context parallelism for the generated chunk ops: one long sequence split into pieces that run
side by side -- across the ranks of a ``torch.distributed`` group (:func:`context_parallel`) or
across the SMs of one GPU (:func:`split_sequence_forward`). Exact: no decayed history is dropped.

Why it works (DESIGN.md section 1): every spec's recurrence is affine in the state, so a piece of a
sequence maps its start state to its end state as ``S_end = M S_start + N`` (``M`` is ``[K, K]``
per value head, ``N`` is ``[K, V]``), and its outputs are affine in the start state too,
``o_t = o_t(0) + S_start^T p_t`` with ``p_t = M_t^T (scale q_t)`` (``M_t`` the transition up to
token ``t``). One call of the generated op yields all of it: append ``K`` zero columns to ``v`` and
start those columns from the identity. The op then returns ``[o(0) | p]`` as its output and
``[N | M]`` as its final state (zero values write nothing, so only the transition acts on the
identity). For the additive family (no delta rule) ``M`` and ``p`` have closed forms that the
wrapper computes from the gates instead (``I``, ``exp(sum g) I`` or ``diag(exp(sum g))``), so the
op runs at its normal width.

The pieces exchange only their ``(M, N)`` pairs (state-sized), compose them to get their true
start states, and add ``S_start^T p_t`` to their outputs -- no second pass. Backward is the same
structure reversed: one backward pass of the op per piece plus an exchange of state gradients
(``dS_start`` of later pieces flows back to earlier ones through ``M^T``).

Varlen (packed sequences, ``cu_seqlens``): a piece boundary may fall inside a sequence; only that
sequence carries state across it, and every sequence that starts inside a piece starts from its own
initial state.

Modules: ``local`` (the call, its one-pass local transfer and the piece layouts, shared),
``distributed`` (:func:`context_parallel` across ranks) and ``intra_card`` (:func:`split_sequence_forward`
across the SMs of one device).
"""
from gdngen.parallel.distributed import COMM_BYTES, context_parallel, shard_sizes, shard_tokens
from gdngen.parallel.intra_card import choose_segments, split_sequence_forward

__all__ = ["context_parallel", "split_sequence_forward", "choose_segments", "shard_tokens", "shard_sizes",
           "COMM_BYTES"]
