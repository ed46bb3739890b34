"""Symbolic proof that the chunk form built from a :class:`ChunkAlgebra` equals the recurrence.

For a small chunk (C tokens, tiny K and V) every input is a free symbol: ``q_t, k_t, v_t``,
``beta_t``, the initial state ``S0`` and the log-decays ``g_t`` (one per token, or one per token
and key channel).  Two computations are compared entry by entry:

* the token recurrence, unrolled (decay first, then the delta correction / additive write);
* the chunk form, assembled only from the algebra's named factors — the cumsum symbols
  ``g_row``/``g_col``/``g_last`` are replaced by sums of the ``g_t`` (inclusive or exclusive as
  the algebra says), ``T = (I + A)^{-1}`` is applied by forward substitution.

To keep everything polynomial, ``exp`` of a linear combination of log-decays is replaced by the
matching monomial in positive symbols ``a_t = exp(g_t)`` (Laurent monomials when a wrong algebra
produces ``exp(-g)``), so ``expand(difference) == 0`` is an exact test, no ``simplify``.
The inter-chunk transfer ``M S0 + N`` is checked against the final state too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import sympy as sp

from .chunk import (DIM_C, DIM_K, DIM_V, G_COL, G_LAST, G_ROW, ChunkAlgebra, _validate, derive,
                    transfer)

__all__ = ["ProofReport", "prove"]


@dataclass(frozen=True)
class ProofReport:
    decay: str
    delta: bool
    C: int
    K: int
    V: int
    #: scalar entries compared (outputs, final state, transfer)
    entries: int
    seconds: float

    def __str__(self) -> str:
        return (f"chunk form == recurrence: decay={self.decay} delta={self.delta} "
                f"C={self.C} K={self.K} V={self.V} ({self.entries} entries, {self.seconds:.2f}s)")


def _exp_to_monomial(expr: sp.Expr, alpha: dict) -> sp.Expr:
    """Replace ``exp(sum_t c_t g_t)`` (integer c_t) by ``prod_t a_t**c_t``."""

    def rule(e: sp.exp) -> sp.Expr:
        arg = sp.expand(e.args[0])
        out = sp.Integer(1)
        for term, coeff in arg.as_coefficients_dict().items():
            if term not in alpha or not coeff.is_Integer:
                raise ValueError(f"decay exponent {arg} is not an integer combination of g_t")
            out *= alpha[term] ** coeff
        return out

    return expr.replace(lambda e: isinstance(e, sp.exp), rule)


class _Chunk:
    """The symbolic inputs of one chunk."""

    def __init__(self, decay: str, C: int, K: int, V: int):
        self.C, self.K, self.V, self.decay = C, K, V, decay
        rng = range(1, C + 1)
        self.q = {t: [sp.Symbol(f"q{t}_{c}") for c in range(K)] for t in rng}
        self.k = {t: [sp.Symbol(f"k{t}_{c}") for c in range(K)] for t in rng}
        self.v = {t: [sp.Symbol(f"v{t}_{d}") for d in range(V)] for t in rng}
        self.beta = {t: sp.Symbol(f"beta{t}") for t in rng}
        self.S0 = sp.Matrix(K, V, lambda c, d: sp.Symbol(f"s_{c}_{d}"))
        # log-decays g[t][c] and alphas a[t][c] = exp(g[t][c]); scalar decay shares one per token
        self.g, self.a = {}, {}
        for t in rng:
            if decay == "vector":
                self.g[t] = [sp.Symbol(f"g{t}_{c}", real=True) for c in range(K)]
                self.a[t] = [sp.Symbol(f"a{t}_{c}", positive=True) for c in range(K)]
            else:
                self.g[t] = [sp.Symbol(f"g{t}", real=True)] * K
                self.a[t] = [sp.Symbol(f"a{t}", positive=True)] * K
        self.alpha = {self.g[t][c]: self.a[t][c] for t in rng for c in range(K)}


def _recurrence(ch: _Chunk, delta: bool):
    """Unroll S' = D_t S; S = S' - beta k (k^T S') + beta k v^T (or S' + k v^T); o = S^T q."""
    S = ch.S0
    outs = []
    for t in range(1, ch.C + 1):
        k = sp.Matrix(ch.k[t])
        v = sp.Matrix(ch.v[t])
        if ch.decay == "none":
            Sd = S
        else:
            Sd = sp.diag(*ch.a[t]) * S
        if delta:
            S = Sd - ch.beta[t] * k * (k.T * Sd) + ch.beta[t] * k * v.T
        else:
            S = Sd + k * v.T
        S = S.applyfunc(sp.expand)
        outs.append((S.T * sp.Matrix(ch.q[t])).applyfunc(sp.expand))
    return outs, S


def _chunk_form(ch: _Chunk, alg: ChunkAlgebra, decay: str, where: str):
    """Assemble W, U, V_new, O and S_next from the algebra's factors only."""
    C, K, V = ch.C, ch.K, ch.V
    if alg.cumsum == "inclusive":
        upto = lambda p: range(1, p + 1)       # noqa: E731
    elif alg.cumsum == "exclusive":
        upto = lambda p: range(1, p)           # noqa: E731
    else:
        raise ValueError(f"unknown cumsum kind {alg.cumsum!r}")
    gamma = {p: [sp.Add(*[ch.g[t][c] for t in upto(p)]) for c in range(K)]
             for p in range(0, C + 1)}
    if decay == "vector" and not alg.per_channel:
        raise AssertionError(
            f"{where}: vector decay needs per_channel factors, the algebra has none")

    def fac(expr, c, row=None, col=None):
        """The factor for key channel c (any channel when not per channel: they coincide)."""
        cc = c if alg.per_channel else 0
        sub = {G_LAST: gamma[C][cc]}
        if row is not None:
            sub[G_ROW] = gamma[row][cc]
        if col is not None:
            sub[G_COL] = gamma[col][cc]
        e = sp.sympify(expr).xreplace(sub)
        stray = e.free_symbols - set(ch.alpha)
        if stray:
            raise AssertionError(f"{where}: factor {expr} uses {sorted(map(str, stray))}, "
                                 f"which has no value where that factor is applied")
        return _exp_to_monomial(e, ch.alpha)

    toks = range(1, C + 1)

    def score(a_vec, i, j):
        # a_i . k_j with the score decay inside (per channel) or outside the contraction
        if alg.per_channel:
            return sp.Add(*[a_vec[c] * ch.k[j][c] * fac(alg.score_decay, c, row=i, col=j)
                            for c in range(K)])
        return fac(alg.score_decay, 0, row=i, col=j) * sp.Add(
            *[a_vec[c] * ch.k[j][c] for c in range(K)])

    if alg.delta:
        if alg.key_w_decay is None:
            raise AssertionError("delta algebra without key_w_decay")
        # rows of diag(beta) (K ⊙ e^{γ}) and diag(beta) V
        bk = {j: [ch.beta[j] * ch.k[j][c] * fac(alg.key_w_decay, c, col=j) for c in range(K)]
              for j in toks}
        bv = {j: [ch.beta[j] * ch.v[j][d] for d in range(V)] for j in toks}
        if alg.strict_lower_system:
            # A_ij = beta_i (k_i . k_j) e^{γi-γj}, i > j; solve (I + A) X = B forward
            A = {(i, j): sp.expand(ch.beta[i] * score(ch.k[i], i, j))
                 for i in toks for j in toks if j < i}
            W, U = {}, {}
            for i in toks:
                W[i] = [sp.expand(bk[i][c] - sp.Add(*[A[i, j] * W[j][c] for j in toks if j < i]))
                        for c in range(K)]
                U[i] = [sp.expand(bv[i][d] - sp.Add(*[A[i, j] * U[j][d] for j in toks if j < i]))
                        for d in range(V)]
        else:
            W, U = bk, bv
        Vnew = {j: [sp.expand(U[j][d] - sp.Add(*[W[j][c] * ch.S0[c, d] for c in range(K)]))
                    for d in range(V)] for j in toks}
    else:
        W = U = None
        Vnew = {j: list(ch.v[j]) for j in toks}

    outs = []
    for i in toks:
        o = []
        for d in range(V):
            inter = sp.Add(*[ch.q[i][c] * fac(alg.query_state_decay, c, row=i) * ch.S0[c, d]
                             for c in range(K)])
            intra = sp.Add(*[score(ch.q[i], i, j) * Vnew[j][d] for j in toks if j <= i])
            o.append(sp.expand(inter + intra))
        outs.append(sp.Matrix(o))
    K_dec = sp.Matrix(C, K, lambda j, c: ch.k[j + 1][c] * fac(alg.key_update_decay, c, col=j + 1))
    D_C = sp.diag(*[fac(alg.state_decay, c) for c in range(K)])
    Vn = sp.Matrix(C, V, lambda j, d: Vnew[j + 1][d])
    S_next = (D_C * ch.S0 + K_dec.T * Vn).applyfunc(sp.expand)
    pieces = dict(K_dec=K_dec, D_C=D_C, W=W, U=U, gamma=gamma)
    return outs, S_next, pieces


def _check(name: str, lhs: sp.Matrix, rhs: sp.Matrix, where: str) -> int:
    for idx in range(len(lhs)):
        diff = sp.expand(lhs[idx] - rhs[idx])
        if diff != 0:
            r, c = divmod(idx, lhs.shape[1])
            raise AssertionError(
                f"{where}: {name}[{r}, {c}] differs from the recurrence; "
                f"difference = {sp.sstr(diff)[:300]}")
    return len(lhs)


def prove(decay: str, delta: bool, C: int = 3, *, K: int = 2, V: int = 2,
          algebra: Optional[ChunkAlgebra] = None, check_transfer: bool = True) -> ProofReport:
    """Prove, for a symbolic chunk of ``C`` tokens, that the chunk form built from ``algebra``
    (default: ``derive(decay, delta)``) gives the same outputs and final state as the recurrence.

    Raises ``AssertionError`` naming the first differing entry.  Pass a deliberately altered
    ``algebra`` to see the proof fail."""
    decay, delta = _validate(decay, delta)
    if C < 1 or K < 1 or V < 1:
        raise ValueError(f"C, K, V must be positive, got C={C}, K={K}, V={V}")
    alg = derive(decay, delta) if algebra is None else algebra
    if alg.decay != decay or alg.delta != delta:
        raise ValueError(f"algebra is for decay={alg.decay} delta={alg.delta}, "
                         f"asked to prove decay={decay} delta={delta}")
    t0 = time.perf_counter()
    where = f"decay={decay} delta={delta} C={C}"
    ch = _Chunk(decay, C, K, V)
    ref_outs, ref_S = _recurrence(ch, delta)
    outs, S_next, pieces = _chunk_form(ch, alg, decay, where)
    n = 0
    for t, (o_ref, o) in enumerate(zip(ref_outs, outs), start=1):
        n += _check(f"o_{t}", o, o_ref, where)
    n += _check("S_next", S_next, ref_S, where)

    if check_transfer:
        tr = transfer(decay, delta)
        sub = {DIM_C: C, DIM_K: K, DIM_V: V, tr.K_dec: pieces["K_dec"], tr.K: sp.Matrix(
            C, K, lambda j, c: ch.k[j + 1][c])}
        if isinstance(tr.D_C, sp.MatrixSymbol):
            sub[tr.D_C] = pieces["D_C"]
        if delta:
            sub[tr.W] = sp.Matrix(C, K, lambda j, c: pieces["W"][j + 1][c])
            sub[tr.U] = sp.Matrix(C, V, lambda j, d: pieces["U"][j + 1][d])
        else:
            sub[tr.V] = sp.Matrix(C, V, lambda j, d: ch.v[j + 1][d])
        M = sp.Matrix(tr.M.subs(sub).doit())
        N = sp.Matrix(tr.N.subs(sub).doit())
        # scalar decay keeps D_C = e^{g_last} I symbolic: evaluate it like the other factors
        g_last = pieces["gamma"][C][0]
        M = M.applyfunc(lambda e: _exp_to_monomial(e.xreplace({G_LAST: g_last}), ch.alpha))
        n += _check("M S0 + N", (M * ch.S0 + N).applyfunc(sp.expand), ref_S, where)
    return ProofReport(decay, delta, C, K, V, n, time.perf_counter() - t0)
