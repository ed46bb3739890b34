"""Print sympy expressions as Triton (``tl.``) source.

Only the constructs the algebra produces are supported — sums, products, quotients, integer
and half powers, ``exp``/``log``/``sqrt``/``abs``/``max``/``min``, :class:`sigmoid`,
:class:`softplus`, numbers and symbols.  Anything else raises ``NotImplementedError`` rather than
leaking sympy syntax into a kernel.  Symbols are printed through a ``names`` mapping (a name
is assumed to be a primary expression such as ``b_g[:, None]``; anything else is parenthesised).

Output is deterministic: terms and factors follow sympy's canonical order, with the positive
terms of a sum printed before the negative ones (``a - b``, not ``-b + a``); numbers print as
Python float literals (``repr(float)``), so ``1`` prints as ``1.0``.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import sympy as sp
from sympy.printing.str import StrPrinter

__all__ = ["TritonPrinter", "to_triton", "LOG2_E"]

#: log2(e): exp(x) == exp2(x * LOG2_E)
LOG2_E = 1.4426950408889634

_PRIMARY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*(\[[^\[\]]*\])*$")


class TritonPrinter(StrPrinter):
    """sympy -> Triton expression printer.  ``use_exp2`` prints ``exp(x)`` as
    ``tl.exp2(x * LOG2_E)`` (the form the fast paths use)."""

    printmethod = "_tritoncode"

    def __init__(self, names: Optional[Mapping[sp.Symbol, str]] = None, use_exp2: bool = False):
        super().__init__()
        self.names = dict(names or {})
        self.use_exp2 = use_exp2

    # -- helpers ------------------------------------------------------------------------------
    def _is_atomic(self, e) -> bool:
        """True when the printed form of ``e`` needs no parentheses as an operand."""
        if e.is_Number or isinstance(e, sp.NumberSymbol):
            return not (e.is_negative or (e.is_Rational and not e.is_Integer))
        if e.is_Symbol:  # _print_Symbol parenthesises names that are not primary
            return True
        if isinstance(e, sp.Pow):
            return e.exp == sp.S.Half
        # function calls (sigmoid prints itself parenthesised)
        return isinstance(e, (sp.Function, sp.Max, sp.Min))

    def _operand(self, e, allow_product: bool = False) -> str:
        s = self._print(e)
        if self._is_atomic(e):
            return s
        if allow_product and isinstance(e, sp.Pow) and e.exp.is_Integer and e.exp > 0:
            return s
        return f"({s})"

    def _name(self, sym) -> str:
        return self.names.get(sym, sym.name)

    @staticmethod
    def _float(x) -> str:
        return repr(float(x))

    # -- dispatch -----------------------------------------------------------------------------
    def _print(self, expr, **kwargs) -> str:
        if isinstance(expr, sp.Basic) and (expr.is_Number or isinstance(expr, sp.NumberSymbol)):
            if expr.is_infinite or expr is sp.nan:
                raise NotImplementedError(f"cannot print {expr} for Triton")
            return self._float(expr)
        if isinstance(expr, (int, float)):
            return self._float(expr)
        return super()._print(expr, **kwargs)

    def _print_Basic(self, expr, **kwargs):
        raise NotImplementedError(f"cannot print {type(expr).__name__} for Triton: {expr}")

    _print_Function = _print_Basic

    def _print_Symbol(self, expr):
        s = self._name(expr)
        return s if _PRIMARY.match(s) else f"({s})"

    def _print_Add(self, expr, order=None):
        terms = list(expr.as_ordered_terms())
        pos = [t for t in terms if not t.could_extract_minus_sign()]
        neg = [t for t in terms if t.could_extract_minus_sign()]
        out = ""
        for t in pos:
            out += (" + " if out else "") + self._print(t)
        for t in neg:
            body = self._print(-t)
            if isinstance(-t, sp.Add):
                body = f"({body})"
            out += (" - " if out else "-") + body
        return out

    def _print_Mul(self, expr):
        coeff, rest = expr.as_coeff_Mul()
        if coeff.is_negative:
            # -expr is a product, a quotient or an atom: a leading minus binds correctly
            return "-" + self._print(-expr)
        num, den = [], []
        for f in sp.Mul.make_args(rest):
            if isinstance(f, sp.Pow) and f.exp.is_Rational and f.exp.is_negative:
                den.append(sp.Pow(f.base, -f.exp))
            else:
                num.append(f)
        num.sort(key=sp.default_sort_key)
        den.sort(key=sp.default_sort_key)
        parts = [] if coeff == 1 else [self._float(coeff)]
        parts += [self._operand(f, allow_product=True) for f in num]
        s = " * ".join(parts) if parts else "1.0"
        if den:
            if len(den) == 1:
                s += " / " + self._operand(den[0])
            else:
                s += " / (" + " * ".join(self._operand(f, allow_product=True) for f in den) + ")"
        return s

    def _print_Pow(self, expr, rational=False):
        base, e = expr.base, expr.exp
        if e == sp.S.Half:
            return f"tl.sqrt({self._print(base)})"
        if e == -sp.S.Half:
            return f"1.0 / tl.sqrt({self._print(base)})"
        if e.is_Integer and e > 0:
            return " * ".join([self._operand(base)] * int(e))
        if e.is_Integer and e < 0:
            return "1.0 / " + self._operand(sp.Pow(base, -e))
        raise NotImplementedError(f"cannot print power {expr} for Triton")

    def _print_exp(self, expr):
        arg = expr.args[0]
        if self.use_exp2:
            return f"tl.exp2({self._operand(arg, allow_product=True)} * {LOG2_E!r})"
        return f"tl.exp({self._print(arg)})"

    def _exp_of(self, expr) -> str:
        """e^expr as printed by :meth:`_print_exp` (exp2 with use_exp2)."""
        return self._print_exp(sp.exp(expr, evaluate=False))

    def _print_log(self, expr):
        return f"tl.log({self._print(expr.args[0])})"

    def _print_Abs(self, expr):
        return f"tl.abs({self._print(expr.args[0])})"

    def _minmax(self, expr, fn):
        args = sorted(expr.args, key=sp.default_sort_key)
        s = self._print(args[0])
        for a in args[1:]:
            s = f"{fn}({s}, {self._print(a)})"
        return s

    def _print_Max(self, expr):
        return self._minmax(expr, "tl.maximum")

    def _print_Min(self, expr):
        return self._minmax(expr, "tl.minimum")

    def _print_sigmoid(self, expr):
        return f"(1.0 / (1.0 + {self._exp_of(-expr.args[0])}))"

    def _print_softplus(self, expr):
        # log(1 + e^x) overflows for large x; there softplus(x) == x to float precision.
        x = self._print(expr.args[0])
        return f"tl.where({x} > 20.0, {x}, tl.log(1.0 + {self._exp_of(expr.args[0])}))"


def to_triton(expr, names: Optional[Mapping[sp.Symbol, str]] = None, *,
              use_exp2: bool = False) -> str:
    """Print ``expr`` as a Triton expression, symbols renamed through ``names``.

    >>> from gdngen.algebra import G_ROW, G_COL, derive
    >>> to_triton(derive("scalar", True).score_decay,
    ...           {G_ROW: "b_g[:, None]", G_COL: "b_g[None, :]"})
    'tl.exp(b_g[:, None] - b_g[None, :])'
    """
    return TritonPrinter(names, use_exp2=use_exp2).doprint(sp.sympify(expr))
