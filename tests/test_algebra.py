"""gdngen.algebra: derivation, symbolic proofs, gates, Triton printer."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp

from gdngen.algebra import (A_LOG, B, DT_BIAS, G_COL, G_LAST, G_ROW, X, ChunkAlgebra,
                            ProofReport, beta_activation, compose, decay_activation, derive,
                            prove, sigmoid, softplus, to_triton, transfer, transition_factor)

STRUCTURES = [(d, dl) for d in ("none", "scalar", "vector") for dl in (False, True)]
NAMES = {G_ROW: "b_g[:, None]", G_COL: "b_g[None, :]", G_LAST: "b_g_last"}
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- derive
def test_derive_no_decay_gives_ones():
    for delta in (False, True):
        a = derive("none", delta)
        for name, f in a.factors().items():
            assert f == sp.Integer(1), name
        assert a.per_channel is False
    assert derive("none", False).key_w_decay is None
    assert derive("none", True).key_w_decay == 1


def test_derive_scalar_exp_forms():
    a = derive("scalar", True)
    assert a.score_decay == sp.exp(G_ROW - G_COL)
    assert a.query_state_decay == sp.exp(G_ROW)
    assert a.key_w_decay == sp.exp(G_COL)
    assert a.key_update_decay == sp.exp(G_LAST - G_COL)
    assert a.state_decay == sp.exp(G_LAST)
    assert a.strict_lower_system and a.delta and not a.per_channel
    assert a.cumsum == "inclusive"
    assert derive("scalar", False).key_w_decay is None
    assert derive("scalar", False).strict_lower_system is False


def test_derive_vector_is_per_channel():
    a = derive("vector", True)
    assert a.per_channel
    assert a.score_decay == sp.exp(G_ROW - G_COL)
    assert derive("vector", False).per_channel


def test_derive_memoised_and_frozen():
    assert derive("scalar", True) is derive("scalar", True)
    assert derive(decay="vector", delta=False) is derive("vector", False)
    assert transfer("vector", True) is transfer("vector", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        derive("scalar", True).delta = False


def test_derive_validates():
    with pytest.raises(ValueError, match="decay"):
        derive("diagonal", True)
    with pytest.raises(TypeError, match="delta"):
        derive("scalar", 1)


def test_transition_factor_telescopes_inclusive_cumsums():
    i, j, C = sp.symbols("i j C", integer=True, positive=True)
    assert transition_factor("scalar", j, i) == sp.exp(G_ROW - G_COL)
    assert transition_factor("scalar", 0, C) == sp.exp(G_LAST)
    assert transition_factor("none", j, C) == 1


def test_transfer_expressions():
    t = transfer("scalar", True)
    assert str(t.M) == "exp(g_last)*I - K_dec.T*W"
    assert str(t.N) == "K_dec.T*U"
    t = transfer("vector", False)
    assert t.M == t.D_C and str(t.N) == "K_dec.T*V" and t.W is None
    assert transfer("none", False).M == sp.Identity(t.D_C.shape[0])


def test_compose_is_affine_composition():
    M1, M2 = sp.Matrix([[1, 2], [3, 4]]), sp.Matrix([[0, 1], [5, -1]])
    N1, N2 = sp.Matrix([[1], [2]]), sp.Matrix([[7], [-3]])
    S = sp.Matrix([[2], [-1]])
    M, N = compose((M1, N1), (M2, N2))
    assert M * S + N == M2 * (M1 * S + N1) + N2


# ----------------------------------------------------------------------------- proofs
@pytest.mark.parametrize("C", [2, 3, 4])
@pytest.mark.parametrize("decay,delta", STRUCTURES)
def test_proof_all_structures(decay, delta, C):
    rep = prove(decay, delta, C)
    assert isinstance(rep, ProofReport)
    assert (rep.decay, rep.delta, rep.C) == (decay, delta, C)
    assert rep.entries == C * rep.V + 2 * rep.K * rep.V


def test_proof_wider_key_dim():
    prove("vector", True, 3, K=3, V=1)


def _alter(decay, delta, **changes) -> ChunkAlgebra:
    return dataclasses.replace(derive(decay, delta), **changes)


WRONG = {
    "exclusive cumsum": ("scalar", True, dict(cumsum="exclusive")),
    "exclusive cumsum, vector": ("vector", False, dict(cumsum="exclusive")),
    "score sign flipped": ("scalar", False, dict(score_decay=sp.exp(G_COL - G_ROW))),
    "score sign flipped, kda": ("vector", True, dict(score_decay=sp.exp(G_COL - G_ROW))),
    "per-channel factor outside contraction": ("vector", True, dict(per_channel=False)),
    "no triangular solve": ("none", True, dict(strict_lower_system=False)),
    "key_w without decay": ("scalar", True, dict(key_w_decay=sp.Integer(1))),
    "key_w uses row cumsum": ("vector", True, dict(key_w_decay=sp.exp(G_ROW))),
    "update forgets -g_col": ("scalar", False, dict(key_update_decay=sp.exp(G_LAST))),
    "state not decayed": ("vector", True, dict(state_decay=sp.Integer(1))),
    "query ignores decay": ("vector", False, dict(query_state_decay=sp.Integer(1))),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_algebra_is_caught(case):
    decay, delta, changes = WRONG[case]
    with pytest.raises(AssertionError, match=f"decay={decay} delta={delta}"):
        prove(decay, delta, 3, algebra=_alter(decay, delta, **changes))


def test_wrong_algebra_message_names_entry():
    bad = _alter("scalar", True, score_decay=sp.exp(G_COL - G_ROW))
    with pytest.raises(AssertionError, match=r"o_2\[0, 0\] differs from the recurrence"):
        prove("scalar", True, 2, algebra=bad)


def test_prove_rejects_mismatched_algebra():
    with pytest.raises(ValueError, match="algebra is for"):
        prove("scalar", True, 2, algebra=derive("vector", True))


# ----------------------------------------------------------------------------- gates
def test_gate_expressions():
    g = decay_activation()
    assert g == -sp.exp(A_LOG) * softplus(X + DT_BIAS)
    assert str(g) == "-exp(A_log)*softplus(dt_bias + x)"
    assert beta_activation(False) == sigmoid(B)
    assert beta_activation(True) == 2 * sigmoid(B)
    # numeric sanity and derivatives
    val = g.subs({X: 0.3, A_LOG: -0.5, DT_BIAS: 0.1}).evalf()
    import math
    assert abs(float(val) + math.exp(-0.5) * math.log1p(math.exp(0.4))) < 1e-12
    assert sp.diff(softplus(X), X) == sigmoid(X)
    assert abs(float(sigmoid(B).subs(B, 0.7).evalf()) - 1 / (1 + math.exp(-0.7))) < 1e-12
    assert softplus(0) == sp.log(2) and sigmoid(0) == sp.Rational(1, 2)


# ----------------------------------------------------------------------------- printer
def test_printer_decay_factors():
    a = derive("scalar", True)
    assert to_triton(a.score_decay, NAMES) == "tl.exp(b_g[:, None] - b_g[None, :])"
    assert to_triton(a.query_state_decay, NAMES) == "tl.exp(b_g[:, None])"
    assert to_triton(a.key_update_decay, NAMES) == "tl.exp(b_g_last - b_g[None, :])"
    assert to_triton(a.state_decay, NAMES) == "tl.exp(b_g_last)"
    assert to_triton(derive("none", True).score_decay, NAMES) == "1.0"


def test_printer_exp2():
    a = derive("scalar", True)
    assert (to_triton(a.score_decay, NAMES, use_exp2=True)
            == "tl.exp2((b_g[:, None] - b_g[None, :]) * 1.4426950408889634)")
    assert (to_triton(a.state_decay, NAMES, use_exp2=True)
            == "tl.exp2(b_g_last * 1.4426950408889634)")


def test_printer_gates():
    names = {X: "b_gr", A_LOG: "A_log", DT_BIAS: "dt_bias", B: "b_b"}
    assert (to_triton(decay_activation(), names)
            == "-tl.exp(A_log) * tl.where(dt_bias + b_gr > 20.0, dt_bias + b_gr, "
               "tl.log(1.0 + tl.exp(dt_bias + b_gr)))")
    assert to_triton(beta_activation(False), names) == "(1.0 / (1.0 + tl.exp(-b_b)))"
    assert to_triton(beta_activation(True), names) == "2.0 * (1.0 / (1.0 + tl.exp(-b_b)))"


@pytest.mark.parametrize("expr,expected", [
    ("x/y", "x / y"),
    ("x/(y*z)", "x / (y * z)"),
    ("1/(x + y)", "1.0 / (x + y)"),
    ("sqrt(x + y)", "tl.sqrt(x + y)"),
    ("y/sqrt(x)", "y / tl.sqrt(x)"),
    ("x**2", "x * x"),
    ("(x + y)**2", "(x + y) * (x + y)"),
    ("x - 2*y", "x - 2.0 * y"),
    ("-x*y", "-x * y"),
    ("x/2", "0.5 * x"),
    ("-x/(y + 1)", "-x / (y + 1.0)"),
    ("exp(-x)*log(y)", "tl.exp(-x) * tl.log(y)"),
    ("1", "1.0"),
    ("-3", "-3.0"),
])
def test_printer_arithmetic(expr, expected):
    assert to_triton(sp.sympify(expr)) == expected


def test_printer_names_and_unsupported():
    x = sp.Symbol("x")
    assert to_triton(2 * x, {x: "a + b"}) == "2.0 * (a + b)"
    with pytest.raises(NotImplementedError):
        to_triton(sp.sin(x))
    with pytest.raises(NotImplementedError):
        to_triton(x ** sp.Rational(1, 3))


def test_printer_deterministic_across_processes():
    code = ("from gdngen.algebra import *\n"
            "a = derive('vector', True)\n"
            "n = {G_ROW: 'r', G_COL: 'c', G_LAST: 'l', X: 'x', A_LOG: 'A', DT_BIAS: 'd', B: 'b'}\n"
            "print([to_triton(e, n) for e in list(a.factors().values()) + "
            "[decay_activation(), beta_activation(True),"
            " (G_ROW - 3 * G_COL + G_LAST) / (A_LOG + B)]])\n")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1
