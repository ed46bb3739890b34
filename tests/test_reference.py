"""The float64 reference interpreter: its three forms agree, it matches hand-worked numbers,
varlen sequences are isolated, fused gates equal their hand-written versions, and autograd
through it is correct (gradcheck)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gdngen import reference as ref
from gdngen.spec import catalogue, load_spec, spec_from_dict

F64 = torch.float64
TOL = 1e-10
CHUNK_SIZES = (16, 32, 64)

SPECS = {p.stem: load_spec(p) for p in catalogue()}
# A variant a user adds by spec: vector decay with the delta rule (Kimi Delta Attention).
SPECS["kda"] = spec_from_dict({"name": "kda", "transition": {"decay": "vector", "delta": True}})
SPEC_NAMES = sorted(SPECS)

VARLEN_LENGTHS = (5, 0, 1, 40, 17)        # includes an empty and a one-token sequence


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs difference relative to the magnitude of the expected tensor."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def make_inputs(spec, *, B=2, T=37, H=2, HV=4, K=8, V=6, N=None, seed=0, positive_qk=False):
    """Fresh random inputs of realistic magnitude for ``spec`` (float64)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    if positive_qk:                        # a feature map (elu + 1) keeps q . sum k > 0
        q, k = F.elu(q) + 1, F.elu(k) + 1
    if spec.has_beta:                      # the delta rule wants unit keys
        k = F.normalize(k, dim=-1)
    g = None
    if spec.transition.decay == "scalar":
        g = F.logsigmoid(randn(B, T, HV))
    elif spec.transition.decay == "vector":
        g = F.logsigmoid(randn(B, T, HV, K))
    beta = torch.sigmoid(randn(B, T, HV)) if spec.has_beta else None
    h0 = randn(B if N is None else N, HV, K, V)
    return q, k, v, g, beta, h0


def varlen_offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# The three forms agree
# ---------------------------------------------------------------------------------------------

CASES = ("zero_state", "initial_state", "varlen")


def _case_kwargs(spec, case, positive_qk=False):
    if case == "varlen":
        cu = varlen_offsets(VARLEN_LENGTHS)
        q, k, v, g, beta, h0 = make_inputs(spec, B=1, T=int(cu[-1]), N=len(VARLEN_LENGTHS),
                                           positive_qk=positive_qk)
        return (q, k, v, g, beta), dict(initial_state=h0, cu_seqlens=cu)
    q, k, v, g, beta, h0 = make_inputs(spec, positive_qk=positive_qk)
    extra = dict(initial_state=h0) if case == "initial_state" else {}
    return (q, k, v, g, beta), extra


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", SPEC_NAMES)
def test_forms_agree(name, case):
    spec = SPECS[name]
    args, kwargs = _case_kwargs(spec, case)
    o_rec, s_rec = ref.recurrent(spec, *args, output_final_state=True, **kwargs)
    assert o_rec.dtype == F64 and s_rec.dtype == F64
    assert o_rec.shape == args[2].shape
    assert torch.isfinite(o_rec).all()
    for chunk_size in CHUNK_SIZES:
        for form in (ref.chunked, ref.scan):
            o, s = form(spec, *args, output_final_state=True, chunk_size=chunk_size, **kwargs)
            where = f"{form.__name__} chunk_size={chunk_size}"
            assert rel_err(o, o_rec) < TOL, where
            assert rel_err(s, s_rec) < TOL, where


@pytest.mark.parametrize("case", CASES)
def test_forms_agree_normalized(case):
    spec = SPECS["linear_attn"]
    args, kwargs = _case_kwargs(spec, case, positive_qk=True)
    o_rec, s_rec = ref.recurrent(spec, *args, output_final_state=True, normalize=True, **kwargs)
    for chunk_size in CHUNK_SIZES:
        for form in (ref.chunked, ref.scan):
            o, s = form(spec, *args, output_final_state=True, normalize=True,
                        chunk_size=chunk_size, **kwargs)
            assert rel_err(o, o_rec) < TOL and rel_err(s, s_rec) < TOL, form.__name__
    # The normaliser changes o but not the state.
    o_plain, s_plain = ref.recurrent(spec, *args, output_final_state=True, **kwargs)
    assert torch.equal(s_plain, s_rec)
    assert rel_err(o_plain, o_rec) > 1e-3


@pytest.mark.parametrize("form", ref.FORMS)
def test_run_dispatch_and_defaults(form):
    spec = SPECS["gated_delta_rule"]
    q, k, v, g, beta, _ = make_inputs(spec, T=20)
    o, s = ref.run(spec, q.float(), k.float(), v.float(), g.float(), beta.float(), form=form)
    assert s is None                                  # output_final_state defaults to False
    assert o.dtype == F64                             # any float input is upcast
    o_expected, _ = ref.recurrent(spec, q.float(), k.float(), v.float(), g.float(), beta.float(),
                                  scale=8 ** -0.5)    # scale defaults to K ** -0.5
    assert rel_err(o, o_expected) < TOL


def test_chunk_sizes_not_in_the_spec_agree():
    # Chunk size 1 and a chunk larger than T are edge cases the algebra must still handle.
    spec = SPECS["kda"]
    q, k, v, g, beta, h0 = make_inputs(spec, T=11)
    o_rec, s_rec = ref.recurrent(spec, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for chunk_size in (1, 3, 64):
        for form in (ref.chunked, ref.scan):
            o, s = form(spec, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        chunk_size=chunk_size)
            assert rel_err(o, o_rec) < TOL and rel_err(s, s_rec) < TOL


def test_gva_head_mapping():
    # Value head hv reads q/k head hv // (HV // H): same as repeating q/k heads by hand.
    spec = SPECS["gla"]
    q, k, v, g, _, h0 = make_inputs(spec, H=2, HV=4)
    o, s = ref.recurrent(spec, q, k, v, g, initial_state=h0, output_final_state=True)
    q4, k4 = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    o4, s4 = ref.recurrent(spec, q4, k4, v, g, initial_state=h0, output_final_state=True)
    assert rel_err(o, o4) < 1e-14 and rel_err(s, s4) < 1e-14
    assert rel_err(o, ref.recurrent(spec, q[:, :, [1, 0]], k[:, :, [1, 0]], v, g)[0]) > 1e-3


# ---------------------------------------------------------------------------------------------
# Varlen isolation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ref.FORMS)
@pytest.mark.parametrize("name", SPEC_NAMES)
def test_varlen_sequences_are_isolated(name, form):
    spec = SPECS[name]
    cu = varlen_offsets(VARLEN_LENGTHS)
    q, k, v, g, beta, h0 = make_inputs(spec, B=1, T=int(cu[-1]), N=len(VARLEN_LENGTHS))
    kw = {} if form == "recurrent" else dict(chunk_size=16)
    fn = getattr(ref, form)
    o, s = fn(spec, q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    for n, (bos, eos) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        def piece(x):
            return None if x is None else x[:, bos:eos]
        o_n, s_n = fn(spec, piece(q), piece(k), piece(v), piece(g), piece(beta),
                      initial_state=h0[n:n + 1], output_final_state=True, **kw)
        assert rel_err(o[:, bos:eos], o_n) < 1e-13 if eos > bos else o_n.numel() == 0
        assert rel_err(s[n:n + 1], s_n) < 1e-13
        if eos == bos:                                 # an empty sequence keeps its state
            assert torch.equal(s[n], h0[n])


def test_varlen_without_initial_state_starts_from_zero():
    spec = SPECS["simple_gla"]
    cu = varlen_offsets((3, 4))
    q, k, v, g, _, _ = make_inputs(spec, B=1, T=7, N=2)
    o, _ = ref.recurrent(spec, q, k, v, g, cu_seqlens=cu)
    o_second, _ = ref.recurrent(spec, q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:])
    assert rel_err(o[:, 3:], o_second) < 1e-14


# ---------------------------------------------------------------------------------------------
# Fused gates equal the same gates written by hand
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_dt_bias", [True, False])
def test_fused_decay_gate(with_dt_bias):
    spec = SPECS["gated_delta_rule"]
    q, k, v, g_raw, beta, h0 = make_inputs(spec)
    gen = torch.Generator().manual_seed(1)
    HV = v.shape[2]
    A_log = torch.rand(HV, generator=gen, dtype=F64) * 2 - 1
    dt_bias = torch.randn(HV, generator=gen, dtype=F64) if with_dt_bias else None
    x = g_raw + (dt_bias if with_dt_bias else 0.0)
    g_by_hand = -torch.exp(A_log) * torch.log1p(torch.exp(x))
    for form in ref.FORMS:
        o, s = ref.run(spec, q, k, v, g_raw, beta, form=form, chunk_size=16, initial_state=h0,
                       output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                       dt_bias=dt_bias)
        o_ref, s_ref = ref.run(spec, q, k, v, g_by_hand, beta, form=form, chunk_size=16,
                               initial_state=h0, output_final_state=True)
        assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_fused_beta_sigmoid(allow_neg_eigval):
    spec = SPECS["gated_delta_rule"]
    q, k, v, g, beta_logits, h0 = make_inputs(spec)
    beta_by_hand = (2.0 if allow_neg_eigval else 1.0) / (1.0 + torch.exp(-beta_logits))
    o, s = ref.run(spec, q, k, v, g, beta_logits, initial_state=h0, output_final_state=True,
                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval)
    o_ref, s_ref = ref.run(spec, q, k, v, g, beta_by_hand, initial_state=h0,
                           output_final_state=True)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
    # beta near 2 flips the sign of the k-component: the chunk forms must follow.
    o_chunk, _ = ref.run(spec, q, k, v, g, beta_logits, form="chunked", chunk_size=16,
                         use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval)
    assert rel_err(o_chunk, ref.run(spec, q, k, v, g, beta_by_hand)[0]) < TOL


def test_fused_qk_l2norm():
    spec = SPECS["delta_rule"]
    q, k, v, _, beta, h0 = make_inputs(spec)
    k = k * 3.0                                           # not unit length before the norm
    def by_hand(x):
        return x / torch.sqrt((x ** 2).sum(-1, keepdim=True) + 1e-6)
    o, s = ref.run(spec, q, k, v, None, beta, initial_state=h0, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = ref.run(spec, by_hand(q), by_hand(k), v, None, beta, initial_state=h0,
                           output_final_state=True)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_prepare_inputs_returns_float64():
    spec = SPECS["gated_delta_rule"]
    q, k, v, g, beta, _ = make_inputs(spec, T=4)
    out = ref.prepare_inputs(spec, q.half(), k.float(), v.float(), g.float(), beta.float())
    assert all(x.dtype == F64 for x in out)


@pytest.mark.parametrize("spec_name, kwargs, offending", [
    ("delta_rule", dict(g=torch.zeros(1, 3, 2)), "g"),
    ("gated_delta_rule", dict(g=None), "g"),
    ("gated_delta_rule", dict(beta=None), "beta"),
    ("gla", dict(beta=torch.zeros(1, 3, 2)), "beta"),
    ("gla", dict(use_gate_in_kernel=True, A_log=torch.zeros(2)), "use_gate_in_kernel"),
    ("gla", dict(use_qk_l2norm_in_kernel=True), "use_qk_l2norm_in_kernel"),
    ("gated_delta_rule", dict(use_gate_in_kernel=True), "A_log"),
    ("gated_delta_rule", dict(A_log=torch.zeros(2)), "A_log"),
    ("gated_delta_rule", dict(allow_neg_eigval=True), "allow_neg_eigval"),
    ("gated_delta_rule", dict(g=torch.zeros(1, 3, 2, 4)), "g"),
    ("simple_gla", dict(normalize=True), "normalize"),
    ("gated_delta_rule", dict(form="parallel"), "form"),
    ("gated_delta_rule", dict(initial_state=torch.zeros(2, 2, 4, 5)), "initial_state"),
    ("gated_delta_rule", dict(cu_seqlens=torch.tensor([0, 2])), "cu_seqlens"),
])
def test_invalid_arguments_name_the_argument(spec_name, kwargs, offending):
    spec = SPECS[spec_name]
    B, T, H, K, V = 1, 3, 2, 4, 5
    gen = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, H, V, generator=gen),
        g=(None if not spec.has_decay else
           -torch.rand(B, T, H, *((K,) if spec.transition.decay == "vector" else ()),
                       generator=gen)),
        beta=torch.rand(B, T, H, generator=gen) if spec.has_beta else None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=offending):
        ref.run(spec, **args)


# ---------------------------------------------------------------------------------------------
# Autograd through the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["recurrent", "chunked", "scan"])
@pytest.mark.parametrize("name", ["gated_delta_rule", "gla"])
def test_gradcheck(name, form):
    spec = SPECS[name]
    q, k, v, g, beta, h0 = make_inputs(spec, B=1, T=5, H=1, HV=2, K=3, V=2, seed=3)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
    kw = {} if form == "recurrent" else dict(chunk_size=2)     # chunks of 2, 2, 1
    fn = getattr(ref, form)

    def f(q, k, v, g, *rest):
        beta, h0 = rest if spec.has_beta else (None, *rest)
        return fn(spec, q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_varlen_chunked():
    spec = SPECS["kda"]
    cu = varlen_offsets((2, 0, 3))
    q, k, v, g, beta, h0 = make_inputs(spec, B=1, T=5, H=1, HV=2, K=3, V=2, N=3, seed=4)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def f(q, k, v, g, beta, h0):
        return ref.chunked(spec, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                           cu_seqlens=cu, chunk_size=2)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Hand-computed anchors (K = V = 1 unless said otherwise; scale = 1)
# ---------------------------------------------------------------------------------------------

def _t(*values):
    return torch.tensor(values, dtype=F64)


@pytest.mark.parametrize("form", ref.FORMS)
def test_hand_computed_gated_delta_rule(form):
    # S0 = 0.5; alpha = (0.5, 0.8); k = (1, 2); v = (2, 1); beta = (0.5, 0.25); q = (3, 1)
    #   t1: S' = 0.5 * 0.5 = 0.25; S1 = 0.25 - 0.5*1*(1*0.25) + 0.5*1*2 = 1.125; o1 = 3 * 1.125
    #   t2: S' = 0.8 * 1.125 = 0.9; S2 = 0.9 - 0.25*2*(2*0.9) + 0.25*2*1 = 0.5;   o2 = 1 * 0.5
    spec = SPECS["gated_delta_rule"]
    q, k, v = _t(3, 1).view(1, 2, 1, 1), _t(1, 2).view(1, 2, 1, 1), _t(2, 1).view(1, 2, 1, 1)
    g, beta = torch.log(_t(0.5, 0.8)).view(1, 2, 1), _t(0.5, 0.25).view(1, 2, 1)
    h0 = _t(0.5).view(1, 1, 1, 1)
    o, s = ref.run(spec, q, k, v, g, beta, form=form, chunk_size=16, initial_state=h0,
                   output_final_state=True)
    torch.testing.assert_close(o.flatten(), _t(3.375, 0.5), rtol=0, atol=1e-14)
    torch.testing.assert_close(s.flatten(), _t(0.5), rtol=0, atol=1e-14)


@pytest.mark.parametrize("form", ref.FORMS)
def test_hand_computed_simple_gla(form):
    # S0 = 1; alpha = (0.5, 0.5); k = (1, 2); v = (2, 1); q = (1, 1)
    #   S1 = 0.5*1 + 1*2 = 2.5; S2 = 0.5*2.5 + 2*1 = 3.25
    spec = SPECS["simple_gla"]
    q, k, v = _t(1, 1).view(1, 2, 1, 1), _t(1, 2).view(1, 2, 1, 1), _t(2, 1).view(1, 2, 1, 1)
    g = torch.log(_t(0.5, 0.5)).view(1, 2, 1)
    o, s = ref.run(spec, q, k, v, g, form=form, chunk_size=16,
                   initial_state=_t(1).view(1, 1, 1, 1), output_final_state=True)
    torch.testing.assert_close(o.flatten(), _t(2.5, 3.25), rtol=0, atol=1e-14)
    torch.testing.assert_close(s.flatten(), _t(3.25), rtol=0, atol=1e-14)


@pytest.mark.parametrize("form", ref.FORMS)
def test_hand_computed_gla_decays_key_rows(form):
    # K = 2, V = 1: the vector decay scales the rows (key channels) of S.
    # S0 = [1, 1]^T; alpha1 = (0.5, 0.25), k1 = (1, 0), v1 = 1 -> S1 = [0.5 + 1, 0.25] = [1.5, 0.25]
    # q1 = (1, 1) -> o1 = 1.75;  alpha2 = (1, 0.5), k2 = (0, 2), v2 = 1 -> S2 = [1.5, 0.125 + 2]
    # q2 = (2, 1) -> o2 = 3 + 2.125 = 5.125
    spec = SPECS["gla"]
    q = _t(1, 1, 2, 1).view(1, 2, 1, 2)
    k = _t(1, 0, 0, 2).view(1, 2, 1, 2)
    v = _t(1, 1).view(1, 2, 1, 1)
    g = torch.log(_t(0.5, 0.25, 1.0, 0.5)).view(1, 2, 1, 2)
    o, s = ref.run(spec, q, k, v, g, form=form, chunk_size=16, scale=1.0,
                   initial_state=_t(1, 1).view(1, 1, 2, 1), output_final_state=True)
    torch.testing.assert_close(o.flatten(), _t(1.75, 5.125), rtol=0, atol=1e-14)
    torch.testing.assert_close(s.flatten(), _t(1.5, 2.125), rtol=0, atol=1e-14)


@pytest.mark.parametrize("form", ref.FORMS)
def test_hand_computed_normalized_linear_attention(form):
    # k = (1, 3); v = (2, 4); q = (1, 1):  S = (2, 14), z = (1, 4) -> o = (2 / 1, 14 / 4)
    spec = SPECS["linear_attn"]
    q, k, v = _t(1, 1).view(1, 2, 1, 1), _t(1, 3).view(1, 2, 1, 1), _t(2, 4).view(1, 2, 1, 1)
    o, s = ref.run(spec, q, k, v, form=form, chunk_size=16, normalize=True,
                   output_final_state=True)
    torch.testing.assert_close(o.flatten(), _t(2.0, 3.5), rtol=0, atol=1e-14)
    torch.testing.assert_close(s.flatten(), _t(14.0), rtol=0, atol=1e-14)


def test_default_scale_is_inverse_sqrt_k():
    spec = SPECS["linear_attn"]
    q, k, v, _, _, _ = make_inputs(spec, T=3, K=4)
    o_default, _ = ref.run(spec, q, k, v)
    o_scaled, _ = ref.run(spec, q, k, v, scale=1.0)
    assert rel_err(o_default, o_scaled / math.sqrt(4)) < 1e-14
