"""Gate parameterisations as sympy expressions, fused into the kernels by the printer.

* log-decay (Mamba2 / GDN style): ``g = -exp(A_log) * softplus(x + dt_bias)``.  ``softplus > 0``
  and ``exp(A_log) > 0`` make ``g < 0``, so every transition ``alpha = exp(g)`` lies in (0, 1):
  the state contracts, and the chunk-local cumsums ``gamma`` decrease monotonically, which keeps
  ``exp(gamma_i - gamma_j)`` (i >= j) at most 1 where the kernels evaluate it.
* write strength: ``beta = sigmoid(b)`` in (0, 1), or ``2 sigmoid(b)`` in (0, 2) so that the
  eigenvalue ``1 - beta |k|^2`` of ``I - beta k k^T`` (unit k) may go negative.
"""
from __future__ import annotations

import sympy as sp

__all__ = ["sigmoid", "softplus", "X", "A_LOG", "DT_BIAS", "B", "decay_activation",
           "beta_activation"]

#: raw per-token decay input (``g_raw`` in the API)
X = sp.Symbol("x", real=True)
#: per-head log of the decay rate A
A_LOG = sp.Symbol("A_log", real=True)
#: per-head bias added before softplus
DT_BIAS = sp.Symbol("dt_bias", real=True)
#: raw write-strength logit
B = sp.Symbol("b", real=True)


class sigmoid(sp.Function):
    """Logistic function ``1 / (1 + exp(-x))``."""

    @classmethod
    def eval(cls, arg):
        if arg.is_zero:
            return sp.Rational(1, 2)
        return None

    def fdiff(self, argindex=1):
        if argindex != 1:
            raise sp.ArgumentIndexError(self, argindex)
        return sigmoid(self.args[0]) * (1 - sigmoid(self.args[0]))

    def _eval_rewrite_as_exp(self, arg, **kwargs):
        return 1 / (1 + sp.exp(-arg))

    def _eval_evalf(self, prec):
        return self._eval_rewrite_as_exp(self.args[0])._eval_evalf(prec)

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_positive(self):
        return True if self.args[0].is_real else None


class softplus(sp.Function):
    """``log(1 + exp(x))``; printed for Triton in an overflow-safe form (see the printer)."""

    @classmethod
    def eval(cls, arg):
        if arg.is_zero:
            return sp.log(2)
        return None

    def fdiff(self, argindex=1):
        if argindex != 1:
            raise sp.ArgumentIndexError(self, argindex)
        return sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, arg, **kwargs):
        return sp.log(1 + sp.exp(arg))

    _eval_rewrite_as_log = _eval_rewrite_as_exp

    def _eval_evalf(self, prec):
        return self._eval_rewrite_as_exp(self.args[0])._eval_evalf(prec)

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_positive(self):
        return True if self.args[0].is_real else None


def decay_activation() -> sp.Expr:
    """``g = -exp(A_log) * softplus(x + dt_bias)`` over :data:`X`, :data:`A_LOG`,
    :data:`DT_BIAS`."""
    return -sp.exp(A_LOG) * softplus(X + DT_BIAS)


def beta_activation(neg_eigval: bool = False) -> sp.Expr:
    """``sigmoid(b)``, or ``2 * sigmoid(b)`` when negative eigenvalues are allowed."""
    return (2 if neg_eigval else 1) * sigmoid(B)
