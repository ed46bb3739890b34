"""Feature maps φ applied to q and k (linear attention, Katharopoulos et al. 2020; Performer).

With a feature map the additive recurrence runs on ``φ(q_t)`` and ``φ(k_t)``::

    S_t = S_{t-1} + φ(k_t) v_t^T,    o_t = S_t^T (scale φ(q_t))

Two kinds:

* **element-wise** maps ``φ(x)_c = f(x_c)`` (:data:`ELEMENTWISE`): ``identity``, ``elu+1``
  (``elu(x) + 1``; FLA and Katharopoulos call it "elu") and ``relu``.  The kernels apply ``f``
  right after loading a q or k tile, so no ``φ(q)``, ``φ(k)`` copy exists.  ``elu+1`` is written
  ``max(x, 0) + exp(min(x, 0))``: equal to ``x + 1`` for ``x > 0`` and ``exp(x)`` otherwise, and
  its ``exp`` never sees a positive argument (no overflow for large inputs).
* **positive random features** (Performer, FAVOR+), :func:`random_features`: with a given
  projection ``W`` of shape ``[m, K]``, ``φ(x)_i = exp(w_i . x - |x|^2 / 2) / sqrt(m)``, so that
  ``E[φ(x) . φ(y)] = exp(x . y)`` for Gaussian ``w_i``.  The feature dimension ``m`` is the state's
  key dimension.  The printed expression takes the projection ``p = w_i . x`` and the half squared
  norm ``n = |x|^2 / 2`` as symbols: the template computes them (a matmul and a row reduction).

Each map's codes (:data:`CODES`) are the ``FEATURE_MAP`` constexpr the kernels branch on.
"""
from __future__ import annotations

import sympy as sp

from gdngen.spec import FEATURE_MAP_ALIASES as ALIASES, FEATURE_MAPS as NAMES

__all__ = ["X", "P", "NORM", "M", "ELEMENTWISE", "CODES", "ALIASES", "NAMES", "elementwise",
           "random_features", "derivative", "canonical"]

#: one input channel of q or k
X = sp.Symbol("x", real=True)
#: Performer: the projection ``w_i . x`` of one row onto one random feature
P = sp.Symbol("p", real=True)
#: Performer: half the squared norm of the row, ``|x|^2 / 2``
NORM = sp.Symbol("n", nonnegative=True)
#: Performer: the number of random features m
M = sp.Symbol("m", positive=True)

#: element-wise maps f(x), one channel at a time
ELEMENTWISE = {
    "identity": X,
    "elu+1": sp.Max(X, 0) + sp.exp(sp.Min(X, 0)),
    "relu": sp.Max(X, 0),
}
#: the FEATURE_MAP constexpr of each map; random features reach the kernels as identity (see
#: the module template: their K -> m projection is computed once by its own kernel)
CODES = {"identity": 0, "elu+1": 1, "relu": 2, "random_features": 0}


def canonical(name: str) -> str:
    """The spec's name of a map given under any accepted spelling (``elu`` -> ``elu+1``)."""
    return ALIASES.get(name, name)


def elementwise(name: str) -> sp.Expr:
    """``f(x)`` of an element-wise map, over :data:`X`."""
    return ELEMENTWISE[name]


def random_features() -> sp.Expr:
    """Performer's positive random feature ``exp(p - n) / sqrt(m)`` over :data:`P`, :data:`NORM`, :data:`M`."""
    return sp.exp(P - NORM) / sp.sqrt(M)


def derivative(name: str) -> sp.Expr:
    """``f'(x)`` of an element-wise map (for the chain rule; ``Heaviside`` at the kinks)."""
    return sp.diff(ELEMENTWISE[name], X)
