"""Chunk-form algebra of the linear-attention family, derived from the token recurrence.

The recurrence (per value head, state ``S`` is ``K x V``; decay applied first, then the write)::

    S'  = D_t S_{t-1}                      D_t = I | exp(g_t) I | diag(exp(g_t))
    S_t = S' - beta_t k_t (k_t^T S') + beta_t k_t v_t^T       (delta family)
    S_t = S' + k_t v_t^T                                      (additive family)
    o_t = S_t^T q_t

Inside a chunk the tokens are numbered ``1..C`` and position ``0`` is the chunk start, where the
incoming state ``S0`` lives.  Every decay factor of the chunk form is the product of the
per-token transitions ``alpha_t = exp(g_t)`` between the moment a quantity is *produced* and the
moment it is *consumed*.  Because decay is applied before the write of the same token, a write
made by token ``j`` has already seen ``D_j``; it is touched by ``D_{j+1} .. D_i`` before token
``i`` reads it after its own ``D_i``.  So the factor between position ``a`` and position ``b`` is
``prod_{t=a+1..b} alpha_t = exp(gamma_b - gamma_a)`` with the *inclusive* chunk-local cumsum
``gamma_b = sum_{t<=b} g_t`` and ``gamma_0 = 0``.  The five factors are that product for five
(producer, consumer) pairs:

* ``score_decay``       key j -> query i:  ``e^{γi-γj}``, q_i (β_i k_i in A) reads k_j's write;
* ``query_state_decay`` start -> query i:  ``e^{γi}``, q_i reads S0 after D_1..D_i;
* ``key_w_decay``       start -> key j:    ``e^{γj}``, k_j's delta correction reads S0 after
  D_1..D_j (decay first, so D_j is included);
* ``key_update_decay``  key j -> end C:    ``e^{γC-γj}``, k_j's write carried to the next chunk;
* ``state_decay``       start -> end C:    ``e^{γC}``, S0 carried to the next chunk.

:func:`derive` computes each of them with sympy (a ``Product`` of the transitions, telescoped to
a difference of prefix sums) and then names the prefix sums by the roles the Triton templates
use: ``g_row`` (query / row token ``i``), ``g_col`` (key / column token ``j``), ``g_last``
(``gamma_C``).  The structure flags select which factors exist: without decay every
transition is 1, without the delta rule there is no ``W``.  For vector decay the same formulas
hold per key channel ``c``, so the factors must be applied inside the contraction over ``K``
(``score_ij = sum_c q_ic k_jc e^{γ_ic-γ_jc}``) — ``per_channel`` says so.

Delta family, why the unit-lower-triangular system: writing ``u_i`` for the effective value
that token ``i`` writes (``S_i = D_i S_{i-1} + k_i u_i^T``), the delta rule gives
``u_i = beta_i (v_i - (D_i S_{i-1})^T k_i)``.  Unrolling ``D_i S_{i-1}`` inside the chunk::

    u_i + beta_i sum_{j<i} (k_i . k_j e^{γi-γj}) u_j = beta_i v_i - beta_i (k_i ⊙ e^{γi})^T S0

i.e. ``(I + A) U_new = diag(beta) V - diag(beta) (K ⊙ e^{γ}) S0`` with ``A`` strictly lower,
hence ``T = (I + A)^{-1}``, ``W = T diag(beta) (K ⊙ e^{γ})``, ``U = T diag(beta) V`` and
``V_new = U - W S0``.  The additive family has ``u_i = v_i`` directly.

Convention note: decay-then-correct, ``S_t = (I - beta k k^T) D_t S_{t-1} + beta k v^T``
(FLA's gated delta rule and KDA).  The other order, ``D_t (I - beta k k^T) S_{t-1}``, is the
same for none/scalar decay (``D_t`` commutes) but not for vector decay, where ``k_j`` would read
the state before ``D_j``; that order would need its own spans (and its own proof).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import sympy as sp

__all__ = [
    "DECAYS", "G_ROW", "G_COL", "G_LAST", "ChunkAlgebra", "derive", "Transfer", "transfer",
    "compose", "transition_factor",
]

DECAYS = ("none", "scalar", "vector")

#: chunk-local inclusive cumsum of the log-decay at the row (query) token i
G_ROW = sp.Symbol("g_row", real=True)
#: chunk-local inclusive cumsum at the column (key) token j
G_COL = sp.Symbol("g_col", real=True)
#: chunk-local inclusive cumsum at the last token of the chunk (gamma_C)
G_LAST = sp.Symbol("g_last", real=True)

# Generic positions inside a chunk: 0 is the chunk start, C the last token.
_t = sp.Symbol("t", integer=True)
_i, _j, _C = sp.symbols("i j C", integer=True, positive=True)
_g = sp.IndexedBase("g", real=True)          # per-token log-decay g_t
_gamma = sp.Function("gamma", real=True)     # inclusive prefix sum, gamma(0) = 0

# Which prefix sum plays which role in the block-level kernels.
_ROLE_OF_POSITION = {_i: G_ROW, _j: G_COL, _C: G_LAST}


def _validate(decay: str, delta: bool) -> tuple[str, bool]:
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    if not isinstance(delta, bool):
        raise TypeError(f"delta must be a bool, got {type(delta).__name__}")
    return decay, delta


def _telescope(expr: sp.Expr) -> sp.Expr:
    """Rewrite ``Product(exp(f), r)`` as ``exp(Sum(f, r))`` and ``Sum(g_t, (t, a+1, b))`` as
    ``gamma(b) - gamma(a)`` (prefix sums, ``gamma(0) = 0``)."""

    def product_rule(p: sp.Product) -> sp.Expr:
        body, limits = p.function, p.limits
        if body == 1:
            return sp.Integer(1)
        if not isinstance(body, sp.exp):
            raise ValueError(f"transition {body} is not an exponential of a log-decay")
        return sp.exp(sp.Sum(body.args[0], *limits))

    def sum_rule(s: sp.Sum) -> sp.Expr:
        (var, lo, hi), = s.limits
        if s.function != _g[var]:
            raise ValueError(f"cannot telescope {s}")
        return _gamma(hi) - _gamma(lo - 1)

    out = expr.replace(lambda e: isinstance(e, sp.Product), product_rule)
    out = out.replace(lambda e: isinstance(e, sp.Sum), sum_rule)
    return out.subs(_gamma(0), 0)


def transition_factor(decay: str, start, end) -> sp.Expr:
    """Decay accumulated between chunk positions ``start`` and ``end`` (``start <= end``):
    ``prod_{t=start+1..end} alpha_t`` with ``alpha_t = exp(g_t)`` (1 without decay), telescoped
    and expressed through the role symbols ``g_row`` / ``g_col`` / ``g_last``.

    ``start`` and ``end`` are among ``0``, ``i`` (row token), ``j`` (column token), ``C``."""
    alpha = sp.Integer(1) if decay == "none" else sp.exp(_g[_t])
    prod = sp.Product(alpha, (_t, start + 1, end))
    out = _telescope(prod)
    return out.xreplace({_gamma(p): sym for p, sym in _ROLE_OF_POSITION.items()})


@dataclass(frozen=True)
class ChunkAlgebra:
    """Named block-level factors of the chunk form for one transition structure.

    All factor fields are sympy expressions over :data:`G_ROW`, :data:`G_COL`, :data:`G_LAST`
    (chunk-local *inclusive* cumsums of the log-decay); ``sympy.Integer(1)`` without decay.
    With ``per_channel`` the cumsums are vectors over K and each factor multiplies its key
    channel inside the contraction over K; otherwise they are per-token scalars.
    """

    decay: str
    delta: bool
    per_channel: bool
    #: the delta family solves the unit-lower-triangular system T = (I + A)^{-1}
    strict_lower_system: bool
    #: on q_i . k_j (and on beta_i k_i . k_j in A), for i >= j
    score_decay: sp.Expr
    #: on q_i where it reads the chunk-start state
    query_state_decay: sp.Expr
    #: on k_j inside W (delta only, else None)
    key_w_decay: Optional[sp.Expr]
    #: on k_j in the state update (K ⊙ e^{γC-γ})^T V_new
    key_update_decay: sp.Expr
    #: on the chunk-start state carried to the next chunk
    state_decay: sp.Expr
    #: how the kernels must form g_row / g_col / g_last from the token log-decays
    cumsum: str = "inclusive"

    @property
    def has_decay(self) -> bool:
        return self.decay != "none"

    def factors(self) -> dict[str, sp.Expr]:
        """The decay factors by name, in a fixed order (``key_w_decay`` only for delta)."""
        out = {
            "score_decay": self.score_decay,
            "query_state_decay": self.query_state_decay,
            "key_update_decay": self.key_update_decay,
            "state_decay": self.state_decay,
        }
        if self.key_w_decay is not None:
            out["key_w_decay"] = self.key_w_decay
        return out


# (producer position, consumer position) for every factor; see the module docstring.
_FACTOR_SPANS = {
    "score_decay": (_j, _i),
    "query_state_decay": (0, _i),
    "key_w_decay": (0, _j),
    "key_update_decay": (_j, _C),
    "state_decay": (0, _C),
}


def derive(decay: str, delta: bool) -> ChunkAlgebra:
    """Derive the chunk-form factors for ``decay in {none, scalar, vector}`` and ``delta``.

    Memoised: the same arguments return the same (frozen) object."""
    return _derive(*_validate(decay, delta))


@functools.lru_cache(maxsize=None)
def _derive(decay: str, delta: bool) -> ChunkAlgebra:
    f = {name: transition_factor(decay, a, b) for name, (a, b) in _FACTOR_SPANS.items()}
    return ChunkAlgebra(
        decay=decay,
        delta=delta,
        per_channel=decay == "vector",
        strict_lower_system=delta,
        score_decay=f["score_decay"],
        query_state_decay=f["query_state_decay"],
        key_w_decay=f["key_w_decay"] if delta else None,
        key_update_decay=f["key_update_decay"],
        state_decay=f["state_decay"],
    )


# ---------------------------------------------------------------------------------------------
# Inter-chunk transfer S_next = M S + N (for context / sequence parallelism)
# ---------------------------------------------------------------------------------------------

#: block dimensions of the transfer expressions
DIM_C, DIM_K, DIM_V = sp.symbols("C d_k d_v", integer=True, positive=True)


@dataclass(frozen=True)
class Transfer:
    """The chunk step as an affine map of the incoming state: ``S_next = M S + N``.

    ``K_dec`` stands for ``K ⊙ key_update_decay`` (row ``j`` scaled by ``e^{γC-γj}``, per
    channel for vector decay) and ``D_C`` for ``state_decay`` as a ``K x K`` operator (identity,
    ``e^{g_last} I`` or ``diag(e^{g_last})``).  Delta: ``V_new = U - W S`` so
    ``S_next = D_C S + K_dec^T (U - W S) = (D_C - K_dec^T W) S + K_dec^T U``; additive:
    ``M = D_C``, ``N = K_dec^T V``.  Pairs compose associatively with :func:`compose`.
    """

    decay: str
    delta: bool
    M: sp.MatrixExpr
    N: sp.MatrixExpr
    D_C: sp.MatrixExpr
    K: sp.MatrixSymbol
    K_dec: sp.MatrixSymbol
    W: Optional[sp.MatrixSymbol]
    U: Optional[sp.MatrixSymbol]
    V: Optional[sp.MatrixSymbol]
    #: K_dec = K ⊙ key_dec_factor (row/channel-wise), the algebra's key_update_decay
    key_dec_factor: sp.Expr
    #: D_C as a scalar/diagonal factor, the algebra's state_decay
    state_factor: sp.Expr


def transfer(decay: str, delta: bool) -> Transfer:
    """Block expressions of the inter-chunk transfer ``(M, N)`` for one structure (memoised)."""
    return _transfer(*_validate(decay, delta))


@functools.lru_cache(maxsize=None)
def _transfer(decay: str, delta: bool) -> Transfer:
    alg = _derive(decay, delta)
    K = sp.MatrixSymbol("K", DIM_C, DIM_K)
    K_dec = sp.MatrixSymbol("K_dec", DIM_C, DIM_K)
    if decay == "none":
        D_C = sp.Identity(DIM_K)
    elif decay == "scalar":
        D_C = alg.state_decay * sp.Identity(DIM_K)
    else:  # diag(exp(g_last)) — a diagonal operator, one entry per key channel
        D_C = sp.MatrixSymbol("D_C", DIM_K, DIM_K)
    W = U = V = None
    if delta:
        W = sp.MatrixSymbol("W", DIM_C, DIM_K)
        U = sp.MatrixSymbol("U", DIM_C, DIM_V)
        M = D_C - K_dec.T * W
        N = K_dec.T * U
    else:
        V = sp.MatrixSymbol("V", DIM_C, DIM_V)
        M = D_C
        N = K_dec.T * V
    return Transfer(decay, delta, M, N, D_C, K, K_dec, W, U, V,
                    key_dec_factor=alg.key_update_decay, state_factor=alg.state_decay)


def compose(left: tuple, right: tuple) -> tuple:
    """Compose two affine state maps, ``left`` applied first: ``(M_R M_L, M_R N_L + N_R)``."""
    (M_L, N_L), (M_R, N_R) = left, right
    return (M_R * M_L, M_R * N_L + N_R)
