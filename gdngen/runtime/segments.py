"""The chunk backward of one long sequence in time segments (issue #4: training memory).

The generated backward recomputes everything chunk-local (gates, L2 norm, the WY factors) and
takes the forward's kept chunk-start states; only its reverse state pass is sequential. For one
long sequence (B == 1, no cu_seqlens) every [1, T, ...] tensor can be cut along the tokens into
contiguous views, so the backward runs once per segment of whole chunks, last segment first:

* segment s covers chunks [c0, c1), tokens [c0 BT, min(c1 BT, T)), and takes the kept states of
  those chunks (``states[c0:c1]``);
* its end-state gradient is the user's ``dht`` for the last segment, else the gradient with
  respect to the state at the start of segment s + 1 (that segment's ``dh0``, float32): the
  reverse pass carries exactly that value in registers across the boundary, so the chain is the
  unsegmented one, bit for bit;
* its gradients are written straight into views of full-size output buffers (no concatenation,
  no full-size copy); the per-head sums of the fused gate (dA_log, dt_bias) are float32 per
  segment, added in a fixed order and cast once.

What the segments save is everything the backward allocates per token besides its outputs: the
chunk-end state gradients (K V per chunk and value head, the size of the kept states), W (later
dW), the float32 T and V_new where the forward did not keep them, and the per-value-head dq / dk
where the call has grouped value heads or the in-kernel L2 norm. At (1, 32768, 32, 32), K = V =
128, bf16, with T and V_new kept and one value head per query head, that is the state gradients
(512 MiB) and W (256 MiB): 768 MiB at once, 384 MiB in each of 2 segments (until stop 32 the
estimate counted T, V_new and dq / dk too: 1.8 GiB, 8 segments of 96 MiB, each segment's Python and
launches paid again: ~0.55 ms of host time per segment on the H200).

Each segment costs ~0.5 ms of host time (its launches, descriptors and Python), which the GPU no longer
hides once the kernels are fast: at stop 42 the step at (1, 32768, 32, 32) ran host-bound in 4 segments
(3.53 ms of host per step back to back, the GPU's ~3.0) and GPU-bound in 2 (2.94 host, 3.01 wall), for
+162 MiB of peak (2122 -> 2284 MiB; one segment: 2600 MiB, 2.97 ms). The budget went 256 -> 512 MiB.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from gdngen.runtime.boundary import active as boundary_hooks
from gdngen.runtime.tiles import _OVERRIDES   # the dict gdngen.runtime.tiles.override() fills

MAX_SEGMENTS = 8
MIN_SEGMENT_CHUNKS = 64          # chunk-parallel launches keep >= 64 chunks x heads programs
SEGMENT_BUDGET_BYTES = 512 << 20  # segment-local intermediates of one backward segment, at most


def intermediate_bytes(*, B: int, T: int, HV: int, K: int, V: int, BT: int, itemsize: int = 2,
                       delta: bool = True, kept_tmat: bool = False, kept_values: bool = False,
                       per_head_qk: bool = True, fused_bwd: bool = False) -> int:
    """Bytes of the backward's token-sized intermediates besides its outputs (estimate).

    Per token and value head: the chunk-end state gradients (K V per chunk); with ``per_head_qk``
    the per-value-head dq and dk before the head-group sum / L2-norm backward (a call with as many
    query as value heads and no in-kernel L2 norm writes them straight into the gradients); for the
    delta rule W (dW), and the float32 T (BT per token) and V_new unless the forward kept them
    (``kept_tmat``, ``kept_values``: the backward then reads the forward's). ``fused_bwd``: the backward
    runs as one fused kernel (stages/backward_fused_gluon.py.j2), whose state gradients and W never leave the
    chip: only the per-value-head dq and dk are left to count."""
    per = 2 * K * itemsize if per_head_qk else 0
    if not fused_bwd:
        per += K * V * itemsize / BT
        if delta:
            per += K * itemsize + (0 if kept_tmat else BT * 4) + (0 if kept_values else V * itemsize)
    return int(B * T * HV * per)


def backward_segments(spec_name: str, *, B: int, T: int, HV: int, K: int, V: int, BT: int, varlen: bool,
                      itemsize: int = 2, delta: bool = True, kept_tmat: bool = False, kept_values: bool = False,
                      per_head_qk: bool = True, fused_bwd: bool = False) -> int:
    """How many time segments the backward of this call runs in (1: the whole call at once).

    1 for a batch (B > 1) or packed sequences (varlen); otherwise the smallest power of two
    S <= MAX_SEGMENTS whose segments' intermediates (:func:`intermediate_bytes` / S) fit
    SEGMENT_BUDGET_BYTES, with every segment >= MIN_SEGMENT_CHUNKS chunks (so 1 below 128
    chunks). ``override(spec_name, "backward_segments", value=S)`` forces S (tests: any S at
    tiny T; still 1 where segments cannot apply, at most one segment per chunk).
    """
    if B != 1 or varlen:
        return 1
    chunks = -(-T // BT)
    forced = _OVERRIDES.get((spec_name, "backward_segments"))
    if forced is not None:
        return max(1, min(int(forced["value"]), chunks))
    need = intermediate_bytes(B=B, T=T, HV=HV, K=K, V=V, BT=BT, itemsize=itemsize, delta=delta,
                              kept_tmat=kept_tmat, kept_values=kept_values, per_head_qk=per_head_qk,
                              fused_bwd=fused_bwd)
    segments = 1
    while (segments < MAX_SEGMENTS and need > segments * SEGMENT_BUDGET_BYTES
           and chunks // (2 * segments) >= MIN_SEGMENT_CHUNKS):
        segments *= 2
    return segments


def segment_bounds(chunks: int, segments: int) -> list[int]:
    """Chunk boundaries [c_0 = 0, c_1, ..., c_S = chunks] of ``segments`` near-equal segments."""
    return [chunks * s // segments for s in range(segments + 1)]


def run_backward_in_segments(backward: Callable, segments: int, do, dht, q, k, v, g, beta, *, initial_state,
                             states, chunk_size: int, cu_seqlens=None, A_log=None, dt_bias=None, kept_tmat=None,
                             kept_values=None, norm=None, gates=None, kept_gates=None, **options):
    """``backward(do, dht, q, k, v, g, beta, ...)`` (a generated ``<op>_backward``) over the whole
    call, in ``segments`` time segments when they apply (see the module text), else in one call.

    Segments need B == 1, no ``cu_seqlens``, the forward's kept ``states`` (``[NC, HV, K, V]``)
    and row-contiguous token-major inputs; anything else runs as one call. ``kept_tmat`` (the
    forward's chunks' T, ``[B, T, HV, BT]``, or None) and ``kept_values`` (its V_new, ``[B, T, HV, V]``,
    or None) are cut by tokens like the inputs. ``norm``
    (normalised linear attention: ``(z, zc)``, or None; passed on only when given): z is cut by
    tokens, ``zc`` (one row per chunk) by chunks, like the states. Returns the backward's
    tuple (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias); in segments dq .. dbeta are full-size
    buffers each segment wrote its tokens of, dh0 is the first segment's, and dA_log / ddt_bias
    the float32 per-segment sums added first segment first, cast to A_log's / dt_bias' dtype.

    ``gates`` (or None): ``gates(q, k, v, g, beta)`` returns the backward's token-major ``(g_cum, beta_act)``
    for the whole call (a generated ``<op>_fwd_states(..., gates_only=True)``: the gates stage of a scalar
    or no decay, token- and chunk-local, [B, T, HV] float32 each); with segments it runs once and each
    segment's backward gets its rows as ``kept_gates`` instead of launching it again: one gates launch
    and two allocations per call instead of one per segment (2 segments at (1, 32768, 32, 32), 8 at
    (1, 131072, 16, 32)), for 8 MiB held through the backward at 32k x 32 heads. (The L2 norm's q and k, and a per-channel decay's [B, T, HV, K] cumsum, are the inputs'
    size: those stay per segment.)
    ``kept_gates`` (or None): that pair as the forward call formed it (the op keeps it): every call gets it,
    in one piece or cut by segments, and ``gates`` is not called.
    """
    B, T = q.shape[0], q.shape[1]
    BT = chunk_size
    chunks = -(-T // BT)
    segments = min(segments, chunks)
    if norm is not None:
        options["norm"] = norm
    one_call = dict(initial_state=initial_state, states=states, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                    A_log=A_log, dt_bias=dt_bias, kept_tmat=kept_tmat, kept_values=kept_values, **options)
    if kept_gates is not None:
        one_call["kept_gates"] = kept_gates
    if (segments <= 1 or B != 1 or cu_seqlens is not None or states is None or states.shape[0] < chunks
            or boundary_hooks() is not None):     # hooks at the state pass see the whole call once
        return backward(do, dht, q, k, v, g, beta, **one_call)
    if do.stride(-1) != 1 or not do.is_contiguous():
        do = do.contiguous()            # a stride-0 o.sum() gradient: the backward would copy it anyway
    tokens = (do, q, k, v, g, beta, kept_tmat, kept_values) + (norm[:1] if norm is not None else ())
    if not all(x is None or x.is_contiguous() for x in tokens):
        return backward(do, dht, q, k, v, g, beta, **one_call)

    # full-size outputs, written segment by segment (uninitialised: every token is some segment's)
    out = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
    if g is not None:
        out["dg"] = torch.empty_like(g)
    if beta is not None:
        out["dbeta"] = torch.empty_like(beta)
    bounds = segment_bounds(chunks, segments)
    shared = kept_gates if kept_gates is not None else gates(q, k, v, g, beta) if gates is not None else None
    carry = dht                         # end-state gradient of the segment being run
    sums = [None] * segments            # (dA_log, ddt_bias) per segment, float32
    for s in reversed(range(segments)):
        c0, c1 = bounds[s], bounds[s + 1]
        t0, t1 = c0 * BT, min(c1 * BT, T)

        def cut(x):
            return None if x is None else x[:, t0:t1]

        # every segment but the first needs its dh0 (the carry): a start state is passed only so
        # that it is written; with ``states`` given the backward never reads its values
        start = initial_state if s == 0 else states[c0:c0 + 1]
        if norm is not None:
            options["norm"] = (cut(norm[0]), norm[1][c0:c1])
        result = backward(cut(do), carry, cut(q), cut(k), cut(v), cut(g), cut(beta), initial_state=start,
                          states=states[c0:c1], kept_tmat=cut(kept_tmat), kept_values=cut(kept_values),
                          chunk_size=chunk_size, cu_seqlens=None, A_log=A_log, dt_bias=dt_bias,
                          out={name: cut(x) for name, x in out.items()}, tile_T=T,
                          **({} if shared is None else {"kept_gates": tuple(map(cut, shared))}), **options)
        carry = result[5]
        sums[s] = (result[6], result[7])
    dh0 = carry if initial_state is not None else None
    dA_log = _ordered_sum([a for a, _ in sums], A_log)
    ddt_bias = _ordered_sum([b for _, b in sums], dt_bias)
    return out["dq"], out["dk"], out["dv"], out.get("dg"), out.get("dbeta"), dh0, dA_log, ddt_bias


def _ordered_sum(parts: list, like: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The float32 parts added first to last (a fixed order: deterministic), cast to ``like``'s dtype."""
    if like is None or parts[0] is None:
        return None
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part
    return total.to(like.dtype)


__all__ = ["MAX_SEGMENTS", "MIN_SEGMENT_CHUNKS", "SEGMENT_BUDGET_BYTES", "backward_segments",
           "intermediate_bytes", "run_backward_in_segments", "segment_bounds"]
