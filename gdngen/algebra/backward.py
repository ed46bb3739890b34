"""Backward of the chunk form: gate-activation derivatives (derived) and the block-level gradient
recipe the backward kernels implement (checked against differentiation of the recurrence).

Derived with ``sympy.diff`` and printed into the gates backward stage:

* :func:`gate_derivatives` — ``dg/dx``, ``dg/dA_log``, ``dg/ddt_bias`` of the fused log-decay
  ``g = -exp(A_log) softplus(x + dt_bias)`` and ``dbeta/db`` of ``sigmoid`` / ``2 sigmoid``;
* :func:`l2norm_backward` — the input gradient of ``y = x rsqrt(|x|^2 + eps)``, checked against
  the Jacobian of that map.

Checked, not derived: :func:`check_chunk_backward` evaluates the gradient *recipe* of the backward
kernels (:func:`chunk_backward_recipe`, block products of the same named decay factors the forward
uses) and compares it, in exact rational arithmetic, with ``sympy.diff`` of the unrolled token
recurrence of one symbolic chunk (:mod:`gdngen.algebra.proof`) for a scalar loss
``sum_t dO_t . o_t + <dS', S_C>``.  The recipe, per chunk (``E_ij = score_decay``, ``M`` causal)::

    dvals = (P ⊙ M)^T dO + (K ⊙ key_update_decay) dS'          P = (Q K^T) ⊙ E  (gradient of V or V_new)
    dS    = state_decay dS' + (Q ⊙ query_state_decay)^T dO [- W^T dvals]     (reverse state pass)
    dQ    = (dO S^T) ⊙ query_state_decay + (dO V^T ⊙ M ⊙ E) K
    dK    = (dO V^T ⊙ M ⊙ E)^T Q + (V dS'^T) ⊙ key_update_decay
    dγ_t  = q_t . dq_t - k_t . dk_t + [t = C] (state_decay <S, dS'> + sum_j k_j . dk_state_j)
    delta: dR = T^T [dW | dvals], dW = -dvals S^T, dA = -(dR R^T) T^T (strictly lower),
           R = [diag(β)(K ⊙ key_w_decay) | diag(β) V], then the chain through A, β and γ
    dg    = reverse cumsum of dγ inside the chunk (γ is the inclusive cumsum of g)

Vector decay (``per_channel``): every factor carries a key channel ``c`` and sits inside the
contraction over K, so ``dγ`` is ``[C, K]`` (no sum over c) and the chain through ``A`` needs
the decayed products ``Y_ic = sum_j dA_ij k_jc E_c[i,j]`` (row side) and
``X_jc = sum_i dA_ij beta_i k_ic E_c[i,j]`` (column side) rather than a scalar ``G = dA ⊙ E``::

    dQ    = (dO S^T) ⊙ query_state_decay + sum_j dP_ij k_j ⊙ E[i,j]          dP = dO V^T ⊙ M
    dK    = sum_i dP_ij q_i ⊙ E[i,j] + (V dS'^T) ⊙ key_update_decay
    dγ    = Q ⊙ dQ - K ⊙ dK, last row += state_decay ⊙ rowsum(S ⊙ dS') + colsum(K ⊙ dK_state)
    delta: dβ += rowsum(K ⊙ Y), dK += diag(β) Y + X, dγ += K ⊙ (diag(β) Y) - K ⊙ X
           (plus the W terms, per channel: dγ += dR_k ⊙ R_k)

Exactness: the check substitutes random rationals (and positive rationals for ``a_t = exp(g_t)``),
so equality is exact; an identity that held only by luck at one point would have to be a root of
a nonzero polynomial, which random points avoid with overwhelming probability.
"""
from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
from types import SimpleNamespace

import sympy as sp

from .chunk import G_COL, G_LAST, G_ROW, _validate, derive
from .gates import A_LOG, B, DT_BIAS, X, beta_activation, decay_activation
from .proof import _Chunk, _exp_to_monomial, _recurrence

__all__ = ["gate_derivatives", "l2norm_backward", "chunk_backward_recipe", "check_chunk_backward",
           "BackwardCheck"]


@functools.lru_cache(maxsize=None)
def gate_derivatives() -> dict:
    """Derivatives of the gate parameterisations, by name (sympy expressions).

    ``decay_dx`` (and ``decay_ddt_bias``, equal) and ``decay_dA_log`` over :data:`X`,
    :data:`A_LOG`, :data:`DT_BIAS`; ``beta_db`` and ``beta_neg_db`` over :data:`B`.
    """
    g = decay_activation()
    out = {
        "decay_dx": sp.diff(g, X),
        "decay_dA_log": sp.diff(g, A_LOG),
        "decay_ddt_bias": sp.diff(g, DT_BIAS),
        "beta_db": sp.diff(beta_activation(False), B),
        "beta_neg_db": sp.diff(beta_activation(True), B),
    }
    if sp.simplify(out["decay_dx"] - out["decay_ddt_bias"]) != 0:
        raise AssertionError("dg/dx and dg/ddt_bias differ: the fused gate is not a function of x + dt_bias")
    return out


def l2norm_backward(K: int = 3) -> sp.Matrix:
    """``dx = r (dy - y (y . dy))`` with ``r = (|x|^2 + eps)^-1/2``, ``y = x r``, checked against
    ``J^T dy`` of the map for a ``K``-vector; returns the checked expression (over ``x_c``, ``dy_c``)."""
    eps = sp.Symbol("eps", positive=True)
    x = sp.Matrix([sp.Symbol(f"x{c}", real=True) for c in range(K)])
    dy = sp.Matrix([sp.Symbol(f"dy{c}", real=True) for c in range(K)])
    r = 1 / sp.sqrt((x.T * x)[0] + eps)
    y = x * r
    jacobian_t_dy = sp.Matrix([sum(dy[i] * sp.diff(y[i], x[c]) for i in range(K)) for c in range(K)])
    recipe = r * (dy - y * (y.T * dy)[0])
    if any(sp.simplify(d) != 0 for d in (jacobian_t_dy - recipe)):
        raise AssertionError("l2norm backward recipe differs from the Jacobian")
    return recipe


def _factor_values(alg, ch: _Chunk, point: dict):
    """Evaluate the algebra's decay factors at a point: returns a function (name, row, col)."""
    C = ch.C
    gamma = {p: sp.Add(*[ch.g[t][0] for t in range(1, p + 1)]) for p in range(0, C + 1)}

    def factor(name, row=None, col=None):
        expr = getattr(alg, name)
        sub = {G_LAST: gamma[C]}
        if row is not None:
            sub[G_ROW] = gamma[row]
        if col is not None:
            sub[G_COL] = gamma[col]
        e = _exp_to_monomial(sp.sympify(expr).xreplace(sub), ch.alpha)
        return e.xreplace(point)
    return factor


def chunk_backward_recipe(decay: str, delta: bool, ch: _Chunk, point: dict, dO, dS, algebra=None):
    """The backward kernels' gradient recipe for one chunk, evaluated at ``point`` (exact).

    ``dO`` is ``[C, V]`` and ``dS`` (the gradient on the chunk's end state) ``[K, V]``.  Returns a
    dict of sympy matrices: ``dq, dk, dv [C, *]``, ``dbeta, dg [C, 1]`` and ``dS0 [K, V]``."""
    alg = derive(decay, delta) if algebra is None else algebra
    if alg.per_channel:
        return _vector_backward_recipe(alg, delta, ch, point, dO, dS)
    C, K, V = ch.C, ch.K, ch.V
    f = _factor_values(alg, ch, point)
    Q = sp.Matrix(C, K, lambda i, c: ch.q[i + 1][c]).xreplace(point)
    Kmat = sp.Matrix(C, K, lambda i, c: ch.k[i + 1][c]).xreplace(point)
    Vmat = sp.Matrix(C, V, lambda i, d: ch.v[i + 1][d]).xreplace(point)
    S0 = ch.S0.xreplace(point)
    beta = [ch.beta[i + 1].xreplace(point) for i in range(C)]
    E = sp.Matrix(C, C, lambda i, j: f("score_decay", i + 1, j + 1) if i >= j else 0)   # ⊙ causal M
    q_dec = sp.Matrix(C, 1, lambda i, _: f("query_state_decay", row=i + 1))
    k_dec = sp.Matrix(C, 1, lambda j, _: f("key_update_decay", col=j + 1))
    s_dec = f("state_decay")

    def rows(vec, mat):                   # diag(vec) mat
        return sp.Matrix(mat.rows, mat.cols, lambda i, c: vec[i] * mat[i, c])

    def rowdot(a, b):
        return sp.Matrix(a.rows, 1, lambda i, _: sum(a[i, c] * b[i, c] for c in range(a.cols)))

    if delta:
        key_w = sp.Matrix(C, 1, lambda j, _: f("key_w_decay", col=j + 1))
        KK = Kmat * Kmat.T
        A = sp.Matrix(C, C, lambda i, j: beta[i] * KK[i, j] * E[i, j] if i > j else 0)
        Tm = (sp.eye(C) + A).inv()
        Rk = rows(beta, rows(key_w, Kmat))
        Rv = rows(beta, Vmat)
        W, U = Tm * Rk, Tm * Rv
        values = U - W * S0
    else:
        values = Vmat
    P = sp.Matrix(C, C, lambda i, j: (Q.row(i) * Kmat.row(j).T)[0] * E[i, j])
    dvals = P.T * dO + rows(k_dec, Kmat) * dS
    dS0 = s_dec * dS + rows(q_dec, Q).T * dO
    if delta:
        dS0 = dS0 - W.T * dvals
    dP = sp.Matrix(C, C, lambda i, j: (dO.row(i) * values.row(j).T)[0] * E[i, j])
    dq = rows(q_dec, dO * S0.T) + dP * Kmat
    dk_state = rows(k_dec, values * dS.T)
    dk = dP.T * Q + dk_state
    dgamma = rowdot(Q, dq) - rowdot(Kmat, dk)
    dgamma[C - 1] += s_dec * sum(S0[c, d] * dS[c, d] for c in range(K) for d in range(V)) \
        + sum(rowdot(Kmat, dk_state))
    dbeta = sp.zeros(C, 1)
    if delta:
        dW = -dvals * S0.T
        dRk, dRv = Tm.T * dW, Tm.T * dvals
        dv = rows(beta, dRv)
        dbeta += rowdot(dRk, rows(key_w, Kmat)) + rowdot(dRv, Vmat)
        dgamma += rowdot(dRk, Rk)
        dA = -(dRk * Rk.T + dRv * Rv.T) * Tm.T
        G = sp.Matrix(C, C, lambda i, j: dA[i, j] * E[i, j] if i > j else 0)
        Y = sp.Matrix(C, C, lambda i, j: G[i, j] * KK[i, j] * beta[i])
        dbeta += sp.Matrix(C, 1, lambda i, _: sum(G[i, j] * KK[i, j] for j in range(C)))
        dgamma += sp.Matrix(C, 1, lambda i, _: sum(Y[i, j] for j in range(C)) - sum(Y[j, i] for j in range(C)))
        dk = dk + rows([b * w for b, w in zip(beta, key_w)], dRk) + rows(beta, G * Kmat) + G.T * rows(beta, Kmat)
    else:
        dv = dvals
    dg = sp.Matrix(C, 1, lambda t, _: sum(dgamma[s] for s in range(t, C)))
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg, dS0=dS0)


def _vector_backward_recipe(alg, delta: bool, ch: _Chunk, point: dict, dO, dS):
    """The per-channel recipe (see the module docstring): every decay factor is evaluated per key
    channel c and applied inside the contraction over K; ``dg`` is ``[C, K]``."""
    C, K, V = ch.C, ch.K, ch.V
    gamma = {p: [sp.Add(*[ch.g[t][c] for t in range(1, p + 1)]) for c in range(K)] for p in range(0, C + 1)}

    def f(name, c, row=None, col=None):
        sub = {G_LAST: gamma[C][c]}
        if row is not None:
            sub[G_ROW] = gamma[row][c]
        if col is not None:
            sub[G_COL] = gamma[col][c]
        return _exp_to_monomial(sp.sympify(getattr(alg, name)).xreplace(sub), ch.alpha).xreplace(point)

    Q = sp.Matrix(C, K, lambda i, c: ch.q[i + 1][c]).xreplace(point)
    Kmat = sp.Matrix(C, K, lambda i, c: ch.k[i + 1][c]).xreplace(point)
    Vmat = sp.Matrix(C, V, lambda i, d: ch.v[i + 1][d]).xreplace(point)
    S0 = ch.S0.xreplace(point)
    beta = [ch.beta[i + 1].xreplace(point) for i in range(C)]
    E = {c: sp.Matrix(C, C, lambda i, j: f("score_decay", c, i + 1, j + 1) if i >= j else 0) for c in range(K)}
    q_dec = sp.Matrix(C, K, lambda i, c: f("query_state_decay", c, row=i + 1))
    k_dec = sp.Matrix(C, K, lambda j, c: f("key_update_decay", c, col=j + 1))
    s_dec = [f("state_decay", c) for c in range(K)]

    def had(a, b):                        # element-wise product
        return sp.Matrix(a.rows, a.cols, lambda i, c: a[i, c] * b[i, c])

    def rows(vec, mat):                   # diag(vec) mat
        return sp.Matrix(mat.rows, mat.cols, lambda i, c: vec[i] * mat[i, c])

    def scores(X, Y, strict):             # sum_c X_ic Y_jc E_c[i, j] on i >= j (i > j when strict)
        return sp.Matrix(C, C, lambda i, j: sum(X[i, c] * Y[j, c] * E[c][i, j] for c in range(K))
                         if (i > j if strict else i >= j) else 0)

    def row_side(M, Y):                   # out_ic = sum_j M_ij Y_jc E_c[i, j]
        return sp.Matrix(C, K, lambda i, c: sum(M[i, j] * Y[j, c] * E[c][i, j] for j in range(C)))

    def col_side(M, X):                   # out_jc = sum_i M_ij X_ic E_c[i, j]
        return sp.Matrix(C, K, lambda j, c: sum(M[i, j] * X[i, c] * E[c][i, j] for i in range(C)))

    if delta:
        key_w = sp.Matrix(C, K, lambda j, c: f("key_w_decay", c, col=j + 1))
        A = rows(beta, scores(Kmat, Kmat, strict=True))
        Tm = (sp.eye(C) + A).inv()
        Rk = rows(beta, had(Kmat, key_w))
        Rv = rows(beta, Vmat)
        W, U = Tm * Rk, Tm * Rv
        values = U - W * S0
    else:
        values = Vmat
    P = scores(Q, Kmat, strict=False)
    dvals = P.T * dO + had(k_dec, Kmat) * dS
    dS0 = sp.diag(*s_dec) * dS + had(q_dec, Q).T * dO
    if delta:
        dS0 = dS0 - W.T * dvals
    dP = sp.Matrix(C, C, lambda i, j: (dO.row(i) * values.row(j).T)[0] if i >= j else 0)
    dq = had(q_dec, dO * S0.T) + row_side(dP, Kmat)
    dk_state = had(k_dec, values * dS.T)
    dk = col_side(dP, Q) + dk_state
    dgamma = had(Q, dq) - had(Kmat, dk)
    for c in range(K):
        dgamma[C - 1, c] += s_dec[c] * sum(S0[c, d] * dS[c, d] for d in range(V)) \
            + sum(Kmat[j, c] * dk_state[j, c] for j in range(C))
    dbeta = sp.zeros(C, 1)
    if delta:
        dW = -dvals * S0.T
        dRk, dRv = Tm.T * dW, Tm.T * dvals
        dv = rows(beta, dRv)
        dbeta += sp.Matrix(C, 1, lambda i, _: sum(dRk[i, c] * Kmat[i, c] * key_w[i, c] for c in range(K))
                           + sum(dRv[i, d] * Vmat[i, d] for d in range(V)))
        dgamma += had(dRk, Rk)
        dA = -(dRk * Rk.T + dRv * Rv.T) * Tm.T
        dA = sp.Matrix(C, C, lambda i, j: dA[i, j] if i > j else 0)
        Y = row_side(dA, Kmat)
        X = col_side(dA, rows(beta, Kmat))
        dbeta += sp.Matrix(C, 1, lambda i, _: sum(Kmat[i, c] * Y[i, c] for c in range(K)))
        dk_rows = rows(beta, Y)
        dgamma += had(Kmat, dk_rows) - had(Kmat, X)
        dk = dk + rows(beta, had(key_w, dRk)) + dk_rows + X
    else:
        dv = dvals
    dg = sp.Matrix(C, K, lambda t, c: sum(dgamma[s, c] for s in range(t, C)))
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg, dS0=dS0)


@dataclass(frozen=True)
class BackwardCheck:
    decay: str
    delta: bool
    C: int
    K: int
    V: int
    entries: int
    seconds: float

    def __str__(self) -> str:
        return (f"chunk backward recipe == d(recurrence): decay={self.decay} delta={self.delta} "
                f"C={self.C} K={self.K} V={self.V} ({self.entries} entries, {self.seconds:.2f}s)")


def check_chunk_backward(decay: str, delta: bool, C: int = 3, *, K: int = 2, V: int = 2,
                         seed: int = 0, algebra=None) -> BackwardCheck:
    """Check the backward recipe against ``sympy.diff`` of the unrolled recurrence for one chunk.

    Every gradient (q, k, v, beta, g, the chunk-start state) is compared exactly at a random
    rational point; ``AssertionError`` names the first difference.  Pass a deliberately altered
    ``algebra`` (a :class:`ChunkAlgebra`) to see the check fail.  Every decay: with vector decay
    the log-decay is one symbol per token and key channel, and ``dg[t, c]`` is checked per channel."""
    decay, delta = _validate(decay, delta)
    t0 = time.perf_counter()
    rng = random.Random(seed)

    def rat():
        return sp.Rational(rng.randint(-9, 9), rng.randint(1, 5))

    ch = _Chunk(decay, C, K, V)
    dO = sp.Matrix(C, V, lambda i, d: rat())
    dS = sp.Matrix(K, V, lambda c, d: rat())
    point = {}
    for t in range(1, C + 1):
        point.update({s: rat() for s in ch.q[t] + ch.k[t] + ch.v[t]})
        point[ch.beta[t]] = sp.Rational(rng.randint(1, 9), 10)
        point.update({a: sp.Rational(rng.randint(1, 9), 10) for a in set(ch.a[t])})
    point.update({s: rat() for s in ch.S0})
    recipe = chunk_backward_recipe(decay, delta, ch, point, dO, dS, algebra)
    eps = sp.Symbol("eps")

    def grad(sym, relative=False):
        """d loss / d sym at the point: the eps coefficient of the recurrence with sym -> value + eps
        (times the value when ``relative``: d/dg_t = a_t d/da_t for a_t = exp(g_t))."""
        moved = dict(point)
        moved[sym] = point[sym] * (1 + eps) if relative else point[sym] + eps
        at = SimpleNamespace(C=C, K=K, V=V, decay=decay,
                             q={t: [moved[s] for s in ch.q[t]] for t in ch.q},
                             k={t: [moved[s] for s in ch.k[t]] for t in ch.k},
                             v={t: [moved[s] for s in ch.v[t]] for t in ch.v},
                             beta={t: moved[ch.beta[t]] for t in ch.beta},
                             a={t: [moved[s] for s in ch.a[t]] for t in ch.a},
                             S0=ch.S0.xreplace(moved))
        outs, S_end = _recurrence(at, delta)
        loss = sum(dO[t, d] * outs[t][d] for t in range(C) for d in range(V)) \
            + sum(dS[c, d] * S_end[c, d] for c in range(K) for d in range(V))
        return sp.expand(loss).coeff(eps, 1)

    where = f"decay={decay} delta={delta} C={C}"
    checks = []
    for t in range(1, C + 1):
        checks += [(f"dq[{t}, {c}]", recipe["dq"][t - 1, c], grad(ch.q[t][c])) for c in range(K)]
        checks += [(f"dk[{t}, {c}]", recipe["dk"][t - 1, c], grad(ch.k[t][c])) for c in range(K)]
        checks += [(f"dv[{t}, {d}]", recipe["dv"][t - 1, d], grad(ch.v[t][d])) for d in range(V)]
        if delta:
            checks.append((f"dbeta[{t}]", recipe["dbeta"][t - 1], grad(ch.beta[t])))
        if decay == "vector":
            # d/dg_tc = a_tc d/da_tc (a_tc = exp(g_tc)), one per key channel
            checks += [(f"dg[{t}, {c}]", recipe["dg"][t - 1, c], grad(ch.a[t][c], relative=True)) for c in range(K)]
        elif decay != "none":
            # d/dg_t = a_t d/da_t (a_t = exp(g_t))
            a = ch.a[t][0]
            checks.append((f"dg[{t}]", recipe["dg"][t - 1], grad(a, relative=True)))
    checks += [(f"dS0[{c}, {d}]", recipe["dS0"][c, d], grad(ch.S0[c, d])) for c in range(K) for d in range(V)]
    for name, got, want in checks:
        if got != want:
            raise AssertionError(f"{where}: {name} = {got}, differentiation gives {want}")
    return BackwardCheck(decay, delta, C, K, V, len(checks), time.perf_counter() - t0)
