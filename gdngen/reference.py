"""Float64 reference interpreter of any :class:`~gdngen.spec.Spec` — the ground truth.

Every generated kernel is tested against this module.  It is plain PyTorch in float64, runs on
whatever device its inputs live on, and is differentiable end to end with autograd, so gradients
of generated kernels can be checked against ``torch.autograd`` through it.

Semantics (DESIGN.md §1), per value head, state ``S`` of shape ``K x V``::

    S' = D_t S_{t-1}                                  decay first: D_t = I | exp(g_t) I | diag(exp(g_t))
    S_t = S' - beta_t k_t (k_t^T S') + beta_t k_t v_t^T      delta family
    S_t = S' + k_t v_t^T                                     additive family
    o_t = S_t^T (scale * q_t)

Three forms compute the same thing and are tested to agree to 1e-10:

* :func:`recurrent` — the token loop, the definition itself;
* :func:`chunked`   — the chunkwise (WY/UT) form, one chunk after another;
* :func:`scan`      — the inter-chunk step ``S_{b+1} = M_b S_b + N_b`` composed with a log-depth
  parallel-prefix scan, then every chunk's outputs from its start state.

Layouts follow FLA: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with ``HV`` a multiple of ``H``
(value head ``hv`` reads q/k head ``hv // (HV // H)``); g ``[B, T, HV]`` (scalar decay) or
``[B, T, HV, K]`` (vector decay), a log-decay; beta ``[B, T, HV]``; states ``[N, HV, K, V]``;
output ``[B, T, HV, V]``.  Varlen input is ``B == 1`` plus ``cu_seqlens`` ``[N + 1]``: the state
restarts from ``initial_state[n]`` (or zeros) at every sequence start and nothing crosses a
sequence boundary.  Without ``cu_seqlens`` each batch row is one sequence (``N == B``).

:func:`prepare_inputs` applies the gate parameterisations a spec may fuse into its kernels
(L2-normalised q/k, ``g = -exp(A_log) softplus(g + dt_bias)``, ``beta = sigmoid`` or
``2 sigmoid``); :func:`run` is the dispatcher that prepares the inputs and calls one form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gdngen.spec import FEATURE_MAP_ALIASES, Spec

__all__ = ["FORMS", "prepare_inputs", "apply_feature_map", "recurrent", "chunked", "scan", "run"]

FORMS = ("recurrent", "chunked", "scan")
L2NORM_EPS = 1e-6          # FLA's l2norm: x * rsqrt(sum(x^2) + eps)

Tensor = torch.Tensor


# =============================================================================================
# Validation — one place, ValueError naming the argument and the shapes
# =============================================================================================

def _shape(x: Optional[Tensor]) -> str:
    return "None" if x is None else str(tuple(x.shape))


def _check_float(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def _check_gate_presence(spec: Spec, g: Optional[Tensor], beta: Optional[Tensor]) -> None:
    if spec.has_decay and g is None:
        raise ValueError(f"g: spec '{spec.name}' has transition.decay "
                         f"'{spec.transition.decay}', so the log-decay g is required")
    if not spec.has_decay and g is not None:
        raise ValueError(f"g: spec '{spec.name}' has transition.decay 'none', "
                         f"so g must be None, got shape {_shape(g)}")
    if spec.has_beta and beta is None:
        raise ValueError(f"beta: spec '{spec.name}' uses the delta rule, so beta is required")
    if not spec.has_beta and beta is not None:
        raise ValueError(f"beta: spec '{spec.name}' is in the additive family (no delta rule), "
                         f"so beta must be None, got shape {_shape(beta)}")


def _check_inputs(spec: Spec, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor],
                  beta: Optional[Tensor], initial_state: Optional[Tensor] = None,
                  cu_seqlens: Optional[Tensor] = None) -> int:
    """Validate shapes against the spec; return the number of sequences N."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {_shape(q)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {_shape(q)}, got {_shape(k)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected [B={B}, T={T}, HV, V], got shape {_shape(v)}")
    HV = v.shape[2]
    if H == 0 or HV % H != 0 or HV == 0:
        raise ValueError(f"v: the value heads HV={HV} must be a positive multiple of the q/k "
                         f"heads H={H} (q {_shape(q)}, v {_shape(v)})")
    if HV != H and not spec.heads.gva:
        raise ValueError(f"v: spec '{spec.name}' has heads.gva false, so HV must equal H={H}, "
                         f"got HV={HV}")

    _check_gate_presence(spec, g, beta)
    if g is not None:
        _check_float("g", g)
        expected = (B, T, HV) if spec.transition.decay == "scalar" else (B, T, HV, K)
        if tuple(g.shape) != expected:
            raise ValueError(f"g: spec '{spec.name}' has {spec.transition.decay} decay, expected "
                             f"shape {expected}, got {_shape(g)}")
    if beta is not None:
        _check_float("beta", beta)
        if tuple(beta.shape) != (B, T, HV):
            raise ValueError(f"beta: expected shape {(B, T, HV)}, got {_shape(beta)}")

    if cu_seqlens is None:
        N = B
    else:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 \
                or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
                or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [N + 1], got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} "
                             f"{_shape(cu_seqlens) if isinstance(cu_seqlens, Tensor) else ''}")
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen input needs B == 1, got q {_shape(q)}")
        offsets = cu_seqlens.tolist()
        if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, "
                             f"got {offsets}")
        N = len(offsets) - 1

    if initial_state is not None:
        _check_float("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, HV, K, v.shape[3]):
            raise ValueError(f"initial_state: expected [N={N}, HV={HV}, K={K}, V={v.shape[3]}], "
                             f"got {_shape(initial_state)}")
    return N


# =============================================================================================
# Gate / input preparation
# =============================================================================================

def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def apply_feature_map(name: str, x: Tensor, projection: Optional[Tensor] = None) -> Tensor:
    """The feature map ``φ`` on the last dimension of ``x``, in ``x``'s dtype (differentiable).

    ``identity``; ``elu+1`` (``elu(x) + 1``, alias ``elu``); ``relu``; ``random_features``
    (Performer's positive features, ``projection`` W ``[m, K]``):
    ``φ(x)_i = exp(w_i . x - |x|^2 / 2) / sqrt(m)``, so the last dimension becomes ``m``.
    """
    name = FEATURE_MAP_ALIASES.get(name, name)
    if name == "identity":
        return x
    if name == "elu+1":
        return F.elu(x) + 1.0
    if name == "relu":
        return F.relu(x)
    if name == "random_features":
        half_norm = 0.5 * (x * x).sum(-1, keepdim=True)
        return torch.exp(x @ projection.to(x.dtype).transpose(0, 1) - half_norm) / math.sqrt(projection.shape[0])
    raise ValueError(f"feature_map: unknown feature map {name!r}")


def _check_feature_map(spec: Spec, feature_map: Optional[str], projection: Optional[Tensor],
                       K: int) -> str:
    """The spec's name of the requested map (identity when None); ValueError naming the argument."""
    name = "identity" if feature_map is None else feature_map
    if not isinstance(name, str):
        raise TypeError(f"feature_map: expected a name or None, got {type(name).__name__}")
    name = FEATURE_MAP_ALIASES.get(name, name)
    if name != "identity" and name not in spec.feature_maps:
        raise ValueError(f"feature_map: spec '{spec.name}' declares feature_maps "
                         f"{list(spec.feature_maps)}, got {feature_map!r}")
    if name == "random_features":
        if projection is None:
            raise ValueError("feature_projection: random_features needs the projection W [m, K]")
        _check_float("feature_projection", projection)
        if projection.dim() != 2 or projection.shape[1] != K or projection.shape[0] < 1:
            raise ValueError(f"feature_projection: expected [m, K={K}], got {_shape(projection)}")
    elif projection is not None:
        raise ValueError("feature_projection: only used with feature_map='random_features'")
    return name


def prepare_inputs(spec: Spec, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                   beta: Optional[Tensor] = None, *, use_qk_l2norm_in_kernel: bool = False,
                   use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                   dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                   allow_neg_eigval: bool = False, feature_map: Optional[str] = None,
                   feature_projection: Optional[Tensor] = None):
    """Apply the spec's fused gate parameterisations and feature map in float64.

    Returns float64 ``(q, k, v, g, beta)`` ready for :func:`recurrent`, :func:`chunked` or
    :func:`scan` (``g`` is None for decay ``none``, ``beta`` None for the additive family):

    * ``use_qk_l2norm_in_kernel``: ``q, k <- x * rsqrt(sum_K x^2 + 1e-6)`` (FLA's l2norm).
    * ``use_gate_in_kernel``: ``g <- -exp(A_log[hv]) * softplus(g + dt_bias[hv])``;
      ``A_log`` and ``dt_bias`` are ``[HV]``, ``dt_bias`` optional (zero).
    * ``use_beta_sigmoid_in_kernel``: ``beta <- sigmoid(beta)``, times 2 if ``allow_neg_eigval``.
    * ``feature_map``: ``q, k <- φ(q), φ(k)`` (:func:`apply_feature_map`, after the L2 norm); with
      ``random_features`` the projection ``feature_projection`` ``[m, K]`` makes the key
      dimension (and the state's) ``m``.

    Each option must be one the spec declares (``qk_l2norm``, ``gates.decay: fused``,
    ``gates.beta: sigmoid``, ``transition.allow_neg_eigval``); otherwise ``ValueError``.
    """
    _check_inputs(spec, q, k, v, g, beta)
    feature_map = _check_feature_map(spec, feature_map, feature_projection, q.shape[-1])
    HV = v.shape[2]
    f64 = torch.float64
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    g = None if g is None else g.to(f64)
    beta = None if beta is None else beta.to(f64)

    if use_qk_l2norm_in_kernel:
        if not spec.qk_l2norm:
            raise ValueError(f"use_qk_l2norm_in_kernel: spec '{spec.name}' has qk_l2norm false")
        q, k = _l2norm(q), _l2norm(k)
    if feature_map != "identity":
        projection = None if feature_projection is None else feature_projection.to(f64)
        q, k = apply_feature_map(feature_map, q, projection), apply_feature_map(feature_map, k, projection)

    if use_gate_in_kernel:
        if "fused" not in spec.gates.decay:
            raise ValueError(f"use_gate_in_kernel: spec '{spec.name}' has gates.decay "
                             f"{list(spec.gates.decay)}, not 'fused'")
        if A_log is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True")
        _check_float("A_log", A_log)
        if tuple(A_log.shape) != (HV,):
            raise ValueError(f"A_log: expected shape ({HV},) (one per value head), "
                             f"got {_shape(A_log)}")
        bias = torch.zeros((), dtype=f64, device=g.device) if dt_bias is None else dt_bias
        if dt_bias is not None:
            _check_float("dt_bias", dt_bias)
            if tuple(dt_bias.shape) != (HV,):
                raise ValueError(f"dt_bias: expected shape ({HV},), got {_shape(dt_bias)}")
        # g is [B, T, HV] here (fused gates exist for scalar decay only): [HV] broadcasts last.
        g = -torch.exp(A_log.to(f64)) * F.softplus(g + bias.to(f64))
    else:
        if A_log is not None or dt_bias is not None:
            name = "A_log" if A_log is not None else "dt_bias"
            raise ValueError(f"{name}: only used with use_gate_in_kernel=True")
        if spec.has_decay and "given" not in spec.gates.decay:
            raise ValueError(f"use_gate_in_kernel: spec '{spec.name}' accepts only the fused "
                             f"gate (gates.decay {list(spec.gates.decay)}); pass True")

    if use_beta_sigmoid_in_kernel:
        if "sigmoid" not in spec.gates.beta or not spec.has_beta:
            raise ValueError(f"use_beta_sigmoid_in_kernel: spec '{spec.name}' has gates.beta "
                             f"{list(spec.gates.beta)}, not 'sigmoid'")
        beta = torch.sigmoid(beta)
        if allow_neg_eigval:
            if not spec.transition.allow_neg_eigval:
                raise ValueError(f"allow_neg_eigval: spec '{spec.name}' has "
                                 f"transition.allow_neg_eigval false")
            beta = 2.0 * beta     # beta in (0, 2): eigenvalues of I - beta k k^T in (-1, 1]
    else:
        if allow_neg_eigval:
            raise ValueError("allow_neg_eigval: scales the sigmoid beta by 2, so it needs "
                             "use_beta_sigmoid_in_kernel=True")
        if spec.has_beta and "given" not in spec.gates.beta:
            raise ValueError(f"use_beta_sigmoid_in_kernel: spec '{spec.name}' accepts only the "
                             f"sigmoid beta (gates.beta {list(spec.gates.beta)}); pass True")
    return q, k, v, g, beta


# =============================================================================================
# Shared driver: layouts, GVA, varlen, normalisation — the forms only see one sequence
# =============================================================================================

# A per-sequence solver takes head-first float64 tensors of one sequence,
#   q, k [HV, L, K]; v [HV, L, V]; log_decay [HV, L, K]; beta [HV, L] or None; state [HV, K, V]
# and returns (o [HV, L, V], final state [HV, K, V]).
SequenceSolver = Callable[..., "tuple[Tensor, Tensor]"]


def _sequence_spans(B: int, T: int, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence, in order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return [(0, bos, eos) for bos, eos in zip(offsets, offsets[1:])]


def _drive(spec: Spec, solve: SequenceSolver, q, k, v, g, beta, *, scale, initial_state,
           output_final_state, cu_seqlens, normalize):
    """Upcast, expand GVA heads, split into sequences, run ``solve`` on each, reassemble."""
    N = _check_inputs(spec, q, k, v, g, beta, initial_state, cu_seqlens)
    if normalize and not spec.normalize:
        raise ValueError(f"normalize: spec '{spec.name}' has normalize false")
    f64 = torch.float64
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else float(scale)

    # GVA: value head hv reads q/k head hv // (HV // H).
    q = q.to(f64).repeat_interleave(HV // H, dim=2)
    k = k.to(f64).repeat_interleave(HV // H, dim=2)
    v = v.to(f64)
    # One per-channel log-decay for every decay kind: none is 0, scalar is the same on every
    # channel.  Exact, and lets all forms share the vector-decay algebra.
    if spec.transition.decay == "none":
        log_decay = q.new_zeros(B, T, HV, K)
    elif spec.transition.decay == "scalar":
        log_decay = g.to(f64).unsqueeze(-1).expand(B, T, HV, K)
    else:
        log_decay = g.to(f64)
    beta = beta.to(f64) if spec.has_beta else None

    if initial_state is None:
        states = [q.new_zeros(HV, K, V) for _ in range(N)]
    else:
        states = list(initial_state.to(f64).unbind(0))
    if normalize:
        # The normaliser z_t = z_{t-1} + k_t is the additive recurrence with v = 1, so carry
        # it as one extra value column (z_0 = 0: it counts only the tokens of this call, as in
        # FLA): o_t = S_t^T (scale q_t) / ((scale q_t) . z_t), scale cancels.
        v = torch.cat([v, v.new_ones(B, T, HV, 1)], dim=-1)
        states = [torch.cat([s, s.new_zeros(HV, K, 1)], dim=-1) for s in states]

    pieces: list[list[Tensor]] = [[] for _ in range(B)]
    finals = []
    for n, (b, bos, eos) in enumerate(_sequence_spans(B, T, cu_seqlens)):
        def head_first(x):
            return x[b, bos:eos].transpose(0, 1)        # [L, HV, ...] -> [HV, L, ...]
        o_seq, final = solve(head_first(q), head_first(k), head_first(v), head_first(log_decay),
                             None if beta is None else head_first(beta), states[n], scale)
        pieces[b].append(o_seq.transpose(0, 1))          # [L, HV, V]
        finals.append(final)

    o = torch.stack([torch.cat(p, dim=0) for p in pieces], dim=0)
    if normalize:
        o = o[..., :V] / o[..., V:]
        finals = [s[..., :V] for s in finals]
    final_state = torch.stack(finals, dim=0) if output_final_state else None
    return o, final_state


# =============================================================================================
# Form 1: the token loop
# =============================================================================================

def _recurrent_sequence(q, k, v, log_decay, beta, state, scale):
    HV, L, _ = q.shape
    outputs = []
    for t in range(L):
        state = torch.exp(log_decay[:, t]).unsqueeze(-1) * state           # S' = D_t S
        k_t, v_t = k[:, t], v[:, t]
        if beta is None:
            write = v_t                                                    # S' + k v^T
        else:
            predicted = torch.einsum("hk,hkv->hv", k_t, state)             # k^T S'
            write = beta[:, t, None] * (v_t - predicted)                   # beta (v - k^T S')
        state = state + k_t.unsqueeze(-1) * write.unsqueeze(-2)
        outputs.append(torch.einsum("hk,hkv->hv", scale * q[:, t], state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(HV, 0, v.shape[-1])
    return o, state


def recurrent(spec: Spec, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
              beta: Optional[Tensor] = None, *, scale: Optional[float] = None,
              initial_state: Optional[Tensor] = None, output_final_state: bool = False,
              cu_seqlens: Optional[Tensor] = None, normalize: bool = False):
    """The recurrence token by token — the definition.

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``, both float64.
    ``g``/``beta`` are taken as given (see :func:`prepare_inputs` for fused gates).
    ``normalize`` (specs with ``normalize: true``) divides by ``q_t . sum_{s<=t} k_s``.
    """
    return _drive(spec, _recurrent_sequence, q, k, v, g, beta, scale=scale,
                  initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, normalize=normalize)


# =============================================================================================
# The chunk algebra shared by the chunked and scan forms
# =============================================================================================

@dataclass
class _ChunkFactors:
    """Everything one chunk contributes, independent of its start state ``S``.

    Shapes carry arbitrary leading batch dims ``...`` (heads, or heads x chunks)::

        q_decayed  [..., C, K]   scale * Q ⊙ e^γ               (inter-chunk output weights)
        scores     [..., C, C]   scale * Σ_c q_ic k_jc e^{γ_ic-γ_jc}, j <= i, else 0
        w          [..., C, K]   T diag(β) (K ⊙ e^γ)             (None: additive family)
        u          [..., C, V]   T diag(β) V                     (V itself: additive family)
        k_to_end   [..., C, K]   K ⊙ e^{γ_C - γ}                 (decay of each write to chunk end)
        decay_end  [..., K]      e^{γ_C}

    With them: ``V_new = U - W S``, ``O = q_decayed S + scores V_new``,
    ``S_next = diag(decay_end) S + k_to_end^T V_new``.
    """
    q_decayed: Tensor
    scores: Tensor
    w: Optional[Tensor]
    u: Tensor
    k_to_end: Tensor
    decay_end: Tensor


def _chunk_factors(q, k, v, log_decay, beta, scale) -> _ChunkFactors:
    """The WY/UT chunk form for inputs ``[..., C, *]`` (any C >= 1).

    Derivation (decay first, then delta): writing ``S_t = Γ_t S_0 + Σ_{j<=t} Γ_t Γ_j^{-1} k_j u_j^T``
    with ``Γ_t = diag(e^{γ_t})`` and ``u_t = β_t (v_t - k_t^T D_t S_{t-1})`` gives
    ``u_t + β_t Σ_{j<t} (Σ_c k_tc k_jc e^{γ_tc-γ_jc}) u_j = β_t v_t - β_t (k_t ⊙ e^{γ_t})^T S_0``,
    i.e. ``(I + A) U_new = diag(β) V - diag(β) (K ⊙ e^γ) S_0``.
    """
    C = q.shape[-2]
    gamma = log_decay.cumsum(dim=-2)                      # inclusive, chunk-local, per channel
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Pairwise γ_i - γ_j per channel, [..., C, C, K].  Only i >= j is kept (there it is <= 0
    # for g <= 0); the rest is zeroed *before* exp so nothing overflows and no inf*0 appears.
    gap = gamma.unsqueeze(-2) - gamma.unsqueeze(-3)
    keep = causal.unsqueeze(-1)
    pair_decay = torch.exp(gap.masked_fill(~keep, 0.0)) * keep

    scores = torch.einsum("...ic,...jc,...ijc->...ij", scale * q, k, pair_decay)
    q_decayed = scale * q * torch.exp(gamma)
    gamma_end = gamma[..., -1:, :]                                     # [..., 1, K]
    k_to_end = k * torch.exp(gamma_end - gamma)
    decay_end = torch.exp(gamma_end.squeeze(-2))

    if beta is None:                                      # additive family: every write is v
        return _ChunkFactors(q_decayed, scores, None, v, k_to_end, decay_end)

    key_gram = torch.einsum("...ic,...jc,...ijc->...ij", k, k, pair_decay)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = beta.unsqueeze(-1) * key_gram * strict                          # strictLower(diag(β) ...)
    unit_lower = A + torch.eye(C, dtype=A.dtype, device=A.device)
    # T = (I + A)^{-1} applied to both right-hand sides in one triangular solve.
    rhs = beta.unsqueeze(-1) * torch.cat([k * torch.exp(gamma), v], dim=-1)
    solved = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    w, u = solved.split([k.shape[-1], v.shape[-1]], dim=-1)
    return _ChunkFactors(q_decayed, scores, w, u, k_to_end, decay_end)


def _chunk_outputs(f: _ChunkFactors, state: Tensor) -> tuple[Tensor, Tensor]:
    """Outputs of a chunk from its start state, and the state at its end."""
    v_new = f.u if f.w is None else f.u - f.w @ state
    o = f.q_decayed @ state + f.scores @ v_new                         # inter + intra
    next_state = f.decay_end.unsqueeze(-1) * state + f.k_to_end.transpose(-1, -2) @ v_new
    return o, next_state


def _chunk_transition(f: _ChunkFactors) -> tuple[Tensor, Tensor]:
    """The chunk as an affine map of its start state: ``S_next = M S + N``."""
    M = torch.diag_embed(f.decay_end)
    N = f.k_to_end.transpose(-1, -2) @ f.u
    if f.w is not None:
        M = M - f.k_to_end.transpose(-1, -2) @ f.w
    return M, N


# =============================================================================================
# Form 2: chunk after chunk
# =============================================================================================

def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    return chunk_size


def _chunked_sequence(q, k, v, log_decay, beta, state, scale, *, chunk_size):
    L = q.shape[1]
    outputs = [v.new_zeros(v.shape[0], 0, v.shape[-1])]
    for start in range(0, L, chunk_size):                 # the last chunk may be shorter
        span = slice(start, start + chunk_size)
        f = _chunk_factors(q[:, span], k[:, span], v[:, span], log_decay[:, span],
                           None if beta is None else beta[:, span], scale)
        o, state = _chunk_outputs(f, state)
        outputs.append(o)
    return torch.cat(outputs, dim=1), state


def chunked(spec: Spec, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
            beta: Optional[Tensor] = None, *, scale: Optional[float] = None,
            initial_state: Optional[Tensor] = None, output_final_state: bool = False,
            cu_seqlens: Optional[Tensor] = None, normalize: bool = False,
            chunk_size: int = 64):
    """The chunkwise form (DESIGN.md §1), chunks processed in order; only ``S`` travels.

    Same arguments and results as :func:`recurrent`; any positive ``chunk_size``.
    """
    chunk_size = _check_chunk_size(chunk_size)

    def solve(*args):
        return _chunked_sequence(*args, chunk_size=chunk_size)
    return _drive(spec, solve, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  normalize=normalize)


# =============================================================================================
# Form 3: associative scan over chunks
# =============================================================================================

def _inclusive_scan(M: Tensor, N: Tensor) -> tuple[Tensor, Tensor]:
    """Hillis–Steele inclusive prefix over dim 1 of affine maps ``S -> M S + N``.

    Element ``b`` becomes the composition of maps ``0..b`` (map 0 applied first), via
    ``(M_L, N_L) then (M_R, N_R) = (M_R M_L, M_R N_L + N_R)``: ``ceil(log2 nb)`` rounds, each
    combining every element with the one ``offset`` to its left in a single batched product.
    """
    offset, n_chunks = 1, M.shape[1]
    while offset < n_chunks:
        left_M, left_N = M[:, :-offset], N[:, :-offset]
        right_M, right_N = M[:, offset:], N[:, offset:]
        M = torch.cat([M[:, :offset], right_M @ left_M], dim=1)
        N = torch.cat([N[:, :offset], right_M @ left_N + right_N], dim=1)
        offset *= 2
    return M, N


def _scan_sequence(q, k, v, log_decay, beta, state, scale, *, chunk_size):
    HV, L, K = q.shape
    Vd = v.shape[-1]
    if L == 0:
        return v.new_zeros(HV, 0, Vd), state
    n_chunks = -(-L // chunk_size)
    pad = n_chunks * chunk_size - L

    # Padding tokens with k = 0, g = 0 leave the state untouched (decay e^0 = 1, write k v^T = 0,
    # delta correction ∝ k = 0), so every chunk can be full and all chunks batched together.
    def chunks(x):
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(HV, n_chunks, chunk_size, *x.shape[2:])

    f = _chunk_factors(chunks(q), chunks(k), chunks(v), chunks(log_decay),
                       None if beta is None else chunks(beta), scale)
    M, N = _chunk_transition(f)                                    # [HV, nb, K, K], [HV, nb, K, V]
    prefix_M, prefix_N = _inclusive_scan(M, N)
    end_states = prefix_M @ state.unsqueeze(1) + prefix_N          # state after chunk b
    start_states = torch.cat([state.unsqueeze(1), end_states[:, :-1]], dim=1)
    o, _ = _chunk_outputs(f, start_states)                         # every chunk at once
    return o.reshape(HV, n_chunks * chunk_size, Vd)[:, :L], end_states[:, -1]


def scan(spec: Spec, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
         beta: Optional[Tensor] = None, *, scale: Optional[float] = None,
         initial_state: Optional[Tensor] = None, output_final_state: bool = False,
         cu_seqlens: Optional[Tensor] = None, normalize: bool = False, chunk_size: int = 64):
    """The chunk form with the inter-chunk recurrence as a log-depth associative scan.

    Each chunk is the affine map ``S -> M_b S + N_b``; a Hillis–Steele prefix gives every
    chunk's start state, then each chunk's outputs follow from it.  Each sequence of a varlen
    batch is scanned on its own, so the scan restarts at every sequence start.
    Same arguments and results as :func:`chunked`.
    """
    chunk_size = _check_chunk_size(chunk_size)

    def solve(*args):
        return _scan_sequence(*args, chunk_size=chunk_size)
    return _drive(spec, solve, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  normalize=normalize)


# =============================================================================================
# Dispatcher
# =============================================================================================

def run(spec: Spec, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
        beta: Optional[Tensor] = None, *, form: str = "recurrent",
        chunk_size: Optional[int] = None, scale: Optional[float] = None,
        initial_state: Optional[Tensor] = None, output_final_state: bool = False,
        cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
        use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
        dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
        allow_neg_eigval: bool = False, normalize: bool = False, feature_map: Optional[str] = None,
        feature_projection: Optional[Tensor] = None):
    """Prepare the inputs (:func:`prepare_inputs`) and evaluate one form.

    ``form`` is one of :data:`FORMS`; ``chunk_size`` (default ``spec.chunk.default``) is used by
    the chunked and scan forms and ignored by the recurrent one.  Returns float64
    ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``.
    """
    if form not in FORMS:
        raise ValueError(f"form: expected one of {list(FORMS)}, got {form!r}")
    q, k, v, g, beta = prepare_inputs(
        spec, q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        feature_map=feature_map, feature_projection=feature_projection)
    common = dict(scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  normalize=normalize)
    if form == "recurrent":
        return recurrent(spec, q, k, v, g, beta, **common)
    chunk_size = spec.chunk.default if chunk_size is None else chunk_size
    form_fn = chunked if form == "chunked" else scan
    return form_fn(spec, q, k, v, g, beta, chunk_size=chunk_size, **common)
