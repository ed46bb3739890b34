"""Generated chunk kernels against the float64 reference under the Triton interpreter (small shapes).

bf16 is not tested here: the interpreter multiplies bf16 bit patterns in tl.dot (triton #11584);
the gpu tier covers it.
"""
import importlib

import pytest
import torch

from gdngen.selfcheck import call, make_inputs, poisoned_memory, reference_outputs, rel_rmse
from gdngen.spec import load_spec

KERNEL_SPECS = ["linear_attn", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda"]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def _module(name):
    return load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")


def _poisoned_call(module, spec, inputs, **options):
    """Run the op with fresh memory NaN-poisoned: any output element the kernels forget to write is NaN."""
    with poisoned_memory():
        return call(module, spec, inputs, **options)


def _check(name, shape, dtype=torch.float32, chunk_size=64, seed=0, **options):
    spec, module = _module(name)
    make = {k: options.pop(k) for k in ("fused_gate", "beta_logits", "h0") if k in options}
    inputs = make_inputs(spec, dtype=dtype, seed=seed, **shape, **make)
    if name == "linear_attn":
        options.setdefault("normalize", False)
    o, ht = _poisoned_call(module, spec, inputs, output_final_state=True, chunk_size=chunk_size, **options)
    ref_options = {k: v for k, v in options.items()}
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **ref_options)
    assert o.dtype == inputs["v"].dtype and ht.dtype == torch.float32
    assert o.shape == o_ref.shape and ht.shape == ht_ref.shape
    tol = TOL[dtype]
    assert rel_rmse(o, o_ref) <= tol, f"o: {rel_rmse(o, o_ref):.3e}"
    assert rel_rmse(ht, ht_ref) <= tol, f"final state: {rel_rmse(ht, ht_ref):.3e}"


@pytest.mark.parametrize("name", KERNEL_SPECS)
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_dense_gva_h0(name, chunk_size):
    _check(name, dict(B=2, T=45, H=2, HV=4, K=16, V=16), chunk_size=chunk_size, seed=chunk_size)


@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_varlen_with_empty_and_single_token_sequences(name):
    _check(name, dict(lengths=[7, 0, 1, 33, 16], H=1, HV=2), chunk_size=16, seed=3)


@pytest.mark.parametrize("name", KERNEL_SPECS)
@pytest.mark.parametrize("K,V", [(20, 12), (100, 20), (8, 40)])
def test_odd_head_dims(name, K, V):
    _check(name, dict(B=1, T=23, H=1, HV=1, K=K, V=V), chunk_size=16, seed=K)


@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_single_token_and_no_initial_state(name):
    _check(name, dict(B=3, T=1, H=1, HV=2, K=16, V=16), h0=False)


@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_fp16(name):
    _check(name, dict(B=1, T=40, H=1, HV=2, K=32, V=32), dtype=torch.float16, chunk_size=32)


def test_gdn_fused_gates_and_l2norm():
    _check("gated_delta_rule", dict(B=1, T=40, H=1, HV=2, K=16, V=16), chunk_size=16, fused_gate=True,
           beta_logits=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
           use_qk_l2norm_in_kernel=True)


def test_gdn_negative_eigenvalues():
    _check("gated_delta_rule", dict(B=1, T=40, H=1, HV=2, K=16, V=16), chunk_size=16, beta_logits=True,
           use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)


def test_delta_rule_l2norm_and_sigmoid():
    _check("delta_rule", dict(B=2, T=30, H=1, HV=1, K=16, V=16), chunk_size=16, beta_logits=True,
           use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)


def test_linear_attn_normalize():
    spec, module = _module("linear_attn")
    inputs = make_inputs(spec, B=1, T=30, H=1, HV=2, K=16, V=16, h0=False)
    inputs["q"], inputs["k"] = inputs["q"].abs(), inputs["k"].abs()   # positive features
    o, _ = call(module, spec, inputs, normalize=True, chunk_size=16)
    o_ref, _ = reference_outputs(spec, inputs, normalize=True)
    assert rel_rmse(o, o_ref) <= 1e-5


def test_final_state_not_requested_returns_none():
    spec, module = _module("simple_gla")
    inputs = make_inputs(spec, B=1, T=8, H=1, HV=1, K=16, V=16)
    o, ht = call(module, spec, inputs)
    assert ht is None and torch.isfinite(o).all()


@pytest.mark.parametrize("name", ["gla", "kda"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_vector_decay_strong_gates_stay_finite(name, chunk_size):
    """Per-channel log-gates down to -20 per token: exp(+cumsum) would overflow float32 within a
    chunk, so the kernels must only ever form decay ratios with exponents <= 0."""
    spec, module = _module(name)
    inputs = make_inputs(spec, B=1, T=50, H=1, HV=2, K=24, V=16, seed=11)
    u = torch.rand(inputs["g"].shape, generator=torch.Generator().manual_seed(5))
    inputs["g"] = -20.0 * u ** 2        # spread over [-20, 0], many channels near -20 per token
    o, ht = _poisoned_call(module, spec, inputs, output_final_state=True, chunk_size=chunk_size)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rmse(o, o_ref) <= 1e-5, f"o: {rel_rmse(o, o_ref):.3e}"
    assert rel_rmse(ht, ht_ref) <= 1e-5, f"final state: {rel_rmse(ht, ht_ref):.3e}"


def test_vector_decay_modules_use_generated_kernels():
    """gla and kda run generated chunk kernels (no float64 fallback)."""
    for name in ("gla", "kda"):
        spec, module = _module(name)
        doc = getattr(module, spec.chunk_function).__doc__
        assert "generated Triton kernels" in doc and "NOTE:" not in module.__doc__, name


def test_gradients_flow_through_reference_backward():
    """Until generated backward kernels land, gradients come from the float64 reference."""
    spec, module = _module("gated_delta_rule")
    inputs = make_inputs(spec, B=1, T=12, H=1, HV=1, K=16, V=16)
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = call(module, spec, {**inputs, **leaves}, output_final_state=True, chunk_size=16)
    (o.sum() + ht.square().sum()).backward()
    ref_leaves = {n: inputs[n].double().clone().requires_grad_() for n in leaves}
    o_ref, ht_ref = reference_outputs(spec, {**inputs, **ref_leaves}, output_final_state=True)
    (o_ref.sum() + ht_ref.square().sum()).backward()
    for n in leaves:
        assert rel_rmse(leaves[n].grad, ref_leaves[n].grad) <= 1e-5, n


def test_kda_l2norm_and_sigmoid():
    _check("kda", dict(B=2, T=37, H=1, HV=2, K=16, V=16), chunk_size=16, beta_logits=True,
           use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)


def test_poisoned_memory_fills_fresh_tensors_with_nan():
    """The poisoning every kernel test relies on really poisons (empty and empty_like alike)."""
    with poisoned_memory():
        a = torch.empty(4, 3)
        b = torch.empty_like(torch.zeros(2, 5, dtype=torch.float16))
    assert torch.isnan(a).all() and torch.isnan(b).all()


@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule", "kda"])
@pytest.mark.parametrize("wu_in_memory", [False, True])
@pytest.mark.parametrize("case", ["dense", "varlen", "odd"])
def test_delta_state_pass_with_and_without_wu_in_memory(name, wu_in_memory, case):
    """Both wy/state variants: T only (V_new formed in the state pass) and W, U written by wy."""
    from gdngen.runtime import override, store_wu
    shape = {"dense": dict(B=2, T=45, H=2, HV=4, K=16, V=16), "varlen": dict(lengths=[7, 0, 1, 33, 16], H=1, HV=2),
             "odd": dict(B=1, T=37, H=1, HV=1, K=20, V=12)}[case]
    with override(name, "store_wu", value=wu_in_memory):
        assert store_wu(name, N=64, HV=64) is wu_in_memory
        _check(name, shape, chunk_size=32 if case == "dense" else 16, seed=11)


def test_store_wu_default_follows_program_count():
    from gdngen.runtime import store_wu
    assert store_wu("gated_delta_rule", N=1, HV=8) is True       # few programs: the chain is critical
    assert store_wu("gated_delta_rule", N=4, HV=32) is False     # many programs: traffic matters
    assert store_wu("kda", N=1, HV=8, per_channel=True) is False  # per-channel decay: T, for precision
