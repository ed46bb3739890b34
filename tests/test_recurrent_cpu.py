"""Generated fused_recurrent_* (token recurrence: decode, verify, state pools) under the interpreter.

Every catalogue spec, against the float64 reference; bf16 is left to the gpu tier (triton #11584).
"""
import importlib

import pytest
import torch

from gdngen.plan import build_plan
from gdngen.selfcheck import make_inputs, poisoned_memory, reference_outputs, rel_rmse
from gdngen.spec import catalogue, load_spec

SPECS = [p.stem for p in catalogue()]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}
P = 6                                   # pool slots
SLOTS = [4, -1, 1]                      # sequence 1 is padding


def _module(name):
    return load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")


def _options(name, **options):
    if name == "linear_attn":
        options.setdefault("normalize", False)
    return options


def _poisoned(fn, *args, **kwargs):
    """Run with fresh memory NaN-poisoned: anything the kernel forgets to write (or must skip) is NaN."""
    with poisoned_memory():
        return fn(*args, **kwargs)


def _recurrent(name, inputs, **options):
    spec, module = _module(name)
    return _poisoned(getattr(module, spec.recurrent_function), **inputs, **_options(name, **options))


def _pool(HV, K, V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(P, HV, K, V, generator=gen, dtype=torch.float64) * 0.5).float()


CASES = {
    "dense_gva_h0": dict(B=2, T=13, H=2, HV=4, K=16, V=16),
    "varlen_3_0_1_9": dict(lengths=[3, 0, 1, 9], H=1, HV=2),
    "odd_dims_K20_V12": dict(B=1, T=9, H=1, HV=2, K=20, V=12),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(name, case):
    spec, _ = _module(name)
    inputs = make_inputs(spec, seed=len(case), **CASES[case])
    o, ht = _recurrent(name, inputs, output_final_state=True)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert o.dtype == inputs["v"].dtype and ht.dtype == torch.float32
    assert o.shape == o_ref.shape and ht.shape == ht_ref.shape
    assert rel_rmse(o, o_ref) <= TOL[torch.float32], f"o: {rel_rmse(o, o_ref):.3e}"
    assert rel_rmse(ht, ht_ref) <= TOL[torch.float32], f"final state: {rel_rmse(ht, ht_ref):.3e}"
    if case.startswith("varlen"):       # the empty sequence hands its initial state back unchanged
        assert torch.equal(ht[1], inputs["initial_state"][1])


@pytest.mark.parametrize("name", SPECS)
def test_fp16_no_initial_state(name):
    spec, _ = _module(name)
    inputs = make_inputs(spec, B=1, T=12, H=1, HV=2, K=32, V=32, dtype=torch.float16, h0=False)
    o, ht = _recurrent(name, inputs, output_final_state=True)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert o.dtype == torch.float16
    assert rel_rmse(o, o_ref) <= TOL[torch.float16] and rel_rmse(ht, ht_ref) <= TOL[torch.float16]


@pytest.mark.parametrize("name", SPECS)
def test_decode_token_by_token_equals_chunk_prefill(name):
    spec, module = _module(name)
    T = 6
    inputs = make_inputs(spec, B=2, T=T, H=1, HV=2, K=16, V=16, seed=5)
    chunk = getattr(module, spec.chunk_function)
    o_pre, h_pre = chunk(**inputs, output_final_state=True, chunk_size=16, **_options(name))
    state, outs = inputs["initial_state"], []
    for t in range(T):
        step = {n: (x[:, t:t + 1] if n in ("q", "k", "v", "g", "beta") else x) for n, x in inputs.items()}
        step["initial_state"] = state
        o_t, state = _recurrent(name, step, output_final_state=True)
        outs.append(o_t)
    assert rel_rmse(torch.cat(outs, 1), o_pre) <= 1e-5
    assert rel_rmse(state, h_pre) <= 1e-5


def _pool_inputs(spec, varlen, seed=2, T=4):
    if varlen:       # a decode batch: one token per sequence, packed
        inputs = make_inputs(spec, lengths=[1, 1, 1], H=1, HV=2, K=16, V=8, h0=False, seed=seed)
    else:
        inputs = make_inputs(spec, B=3, T=T, H=1, HV=2, K=16, V=8, h0=False, seed=seed)
    pool = _pool(2, 16, 8, seed=seed)
    return inputs, pool


def _pool_reference(spec, inputs, pool, **options):
    start = pool[[max(s, 0) for s in SLOTS]]
    return reference_outputs(spec, {**inputs, "initial_state": start}, output_final_state=True, **options)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_state_pool_in_place(name, varlen):
    spec, _ = _module(name)
    inputs, pool = _pool_inputs(spec, varlen)
    before = pool.clone()
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    o, returned = _recurrent(name, {**inputs, "initial_state": pool}, state_indices=slots)
    assert returned is pool
    o_ref, ht_ref = _pool_reference(spec, inputs, before)
    rows = (lambda x, n: x[n]) if not varlen else (lambda x, n: x[0, n:n + 1])
    for n in (0, 2):
        assert rel_rmse(rows(o, n), rows(o_ref, n)) <= 1e-5
        assert rel_rmse(pool[SLOTS[n]], ht_ref[n]) <= 1e-5
    for s in (0, 2, 3, 5):
        assert torch.equal(pool[s], before[s]), f"slot {s} touched"
    assert torch.isnan(rows(o, 1)).all(), "the padding sequence's output was written"


@pytest.mark.parametrize("name", SPECS)
def test_verify_leaves_pool_untouched_and_returns_every_state(name):
    spec, _ = _module(name)
    T = 4
    inputs, pool = _pool_inputs(spec, varlen=False, T=T)
    before = pool.clone()
    slots = torch.tensor(SLOTS, dtype=torch.int64)
    o, returned, hs = _recurrent(name, {**inputs, "initial_state": pool}, state_indices=slots,
                                 inplace_final_state=False, return_intermediate_states=True)
    assert torch.equal(pool, before) and returned is pool
    assert hs.shape == (3, T, 2, 16, 8) and hs.dtype == torch.float32
    assert torch.isnan(hs[1]).all(), "the padding sequence's states were written"
    o_ref, _ = _pool_reference(spec, inputs, before)
    for n in (0, 2):
        assert rel_rmse(o[n], o_ref[n]) <= 1e-5
    for t in range(T):
        prefix = {n: (x[:, :t + 1] if n in ("q", "k", "v", "g", "beta") else x) for n, x in inputs.items()}
        _, h_ref = _pool_reference(spec, prefix, before)
        for n in (0, 2):
            assert rel_rmse(hs[n, t], h_ref[n]) <= 1e-5, (t, n)


@pytest.mark.parametrize("name", ["gla", "gated_delta_rule"])
def test_intermediate_states_caller_buffer_varlen(name):
    """A caller buffer longer than the longest sequence: only each sequence's tokens are written."""
    spec, _ = _module(name)
    lengths = [3, 0, 2]
    inputs = make_inputs(spec, lengths=lengths, H=1, HV=2, K=16, V=8, seed=4)
    hs = torch.full((3, 5, 2, 16, 8), -7.0)
    o, ht = _recurrent(name, inputs, output_final_state=True, intermediate_states=hs)
    _, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(hs[0, 2], ht_ref[0]) <= 1e-5 and rel_rmse(hs[2, 1], ht_ref[2]) <= 1e-5
    assert torch.equal(hs[0, 2], ht[0]) and torch.equal(hs[2, 1], ht[2])
    for n, L in enumerate(lengths):
        assert (hs[n, L:] == -7.0).all(), n


@pytest.mark.parametrize("name", SPECS)
def test_verify_then_commit(name):
    """Verify 4 draft tokens, accept 2: copying intermediate_states[n, 1] into the pool == re-running them."""
    spec, _ = _module(name)
    accepted = 2
    inputs, pool = _pool_inputs(spec, varlen=False, T=4, seed=7)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    _, _, hs = _recurrent(name, {**inputs, "initial_state": pool}, state_indices=slots,
                          inplace_final_state=False, return_intermediate_states=True)
    committed = pool.clone()
    for n, s in enumerate(SLOTS):
        if s >= 0:
            committed[s] = hs[n, accepted - 1]
    recomputed = pool.clone()
    prefix = {n: (x[:, :accepted] if n in ("q", "k", "v", "g", "beta") else x) for n, x in inputs.items()}
    _recurrent(name, {**prefix, "initial_state": recomputed}, state_indices=slots)
    assert torch.allclose(committed, recomputed, rtol=1e-6, atol=1e-6)
    for s in (0, 2, 3, 5):
        assert torch.equal(committed[s], pool[s]) and torch.equal(recomputed[s], pool[s])


def test_gdn_fused_gates_l2norm_neg_eigval():
    spec, _ = _module("gated_delta_rule")
    inputs = make_inputs(spec, B=2, T=10, H=1, HV=2, K=16, V=16, fused_gate=True, beta_logits=True, seed=9)
    opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                use_qk_l2norm_in_kernel=True)
    o, ht = _recurrent("gated_delta_rule", inputs, output_final_state=True, **opts)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **opts)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5
    # no dt_bias, plain sigmoid
    inputs["dt_bias"] = None
    opts["allow_neg_eigval"] = False
    o, ht = _recurrent("gated_delta_rule", inputs, output_final_state=True, **opts)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **opts)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5


def test_delta_rule_l2norm_and_sigmoid():
    spec, _ = _module("delta_rule")
    inputs = make_inputs(spec, B=1, T=10, H=1, HV=1, K=16, V=16, beta_logits=True, seed=10)
    opts = dict(use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    o, ht = _recurrent("delta_rule", inputs, output_final_state=True, **opts)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **opts)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5


def test_linear_attn_normalize():
    spec, _ = _module("linear_attn")
    inputs = make_inputs(spec, B=1, T=12, H=1, HV=2, K=16, V=16, h0=False)
    inputs["q"], inputs["k"] = inputs["q"].abs(), inputs["k"].abs()   # positive features
    o, ht = _recurrent("linear_attn", inputs, normalize=True, output_final_state=True)
    o_ref, ht_ref = reference_outputs(spec, inputs, normalize=True, output_final_state=True)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5 and ht.shape[-1] == 16


def test_final_state_not_requested_returns_none():
    spec, _ = _module("simple_gla")
    inputs = make_inputs(spec, B=1, T=3, H=1, HV=1, K=16, V=16)
    o, ht = _recurrent("simple_gla", inputs)
    assert ht is None and torch.isfinite(o).all()


def _bad_call(name="gated_delta_rule", **overrides):
    spec, module = _module(name)
    inputs, pool = _pool_inputs(spec, varlen=False)
    kwargs = dict(initial_state=pool, state_indices=torch.tensor(SLOTS, dtype=torch.int32))
    kwargs.update(overrides)
    return getattr(module, spec.recurrent_function)(**inputs, **_options(name, **kwargs))


@pytest.mark.parametrize("overrides,error,match", [
    (dict(state_indices=torch.tensor([4., -1., 1.])), TypeError, "state_indices"),
    (dict(state_indices=[4, -1, 1]), TypeError, "state_indices"),
    (dict(state_indices=torch.tensor([4, -1, 6], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([4, -2, 1], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([4, 1], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([[4, -1, 1]], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([1, -1, 1], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(initial_state=None), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(6, 2, 16, 9)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(6, 2, 16, 8, dtype=torch.float64)), TypeError, "initial_state"),
    (dict(initial_state=torch.zeros(6, 2, 8, 16).transpose(2, 3)), ValueError, "initial_state"),
    (dict(intermediate_states=torch.zeros(3, 3, 2, 16, 8)), ValueError, "intermediate_states"),
    (dict(intermediate_states=torch.zeros(3, 4, 2, 16, 8, dtype=torch.float16)), TypeError, "intermediate_states"),
    (dict(state_indices=None, initial_state=None, inplace_final_state=False), ValueError, "inplace_final_state"),
])
def test_validation_names_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**overrides)


def test_linear_attn_normalize_rejects_pool():
    with pytest.raises(ValueError, match="normalize"):
        _bad_call("linear_attn", normalize=True)


def test_inference_only():
    spec, module = _module("gated_delta_rule")
    inputs = make_inputs(spec, B=1, T=3, H=1, HV=1, K=16, V=16)
    inputs["q"] = inputs["q"].requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        module.fused_recurrent_gated_delta_rule(**inputs)
    with torch.no_grad():
        o, _ = module.fused_recurrent_gated_delta_rule(**inputs)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("name", SPECS)
def test_plan_and_module_export_the_recurrent_stage(name):
    spec, module = _module(name)
    assert "recurrent" in [s.name for s in build_plan(spec).stages]
    assert spec.recurrent_function in module.__all__
    assert "inference-only" in getattr(module, spec.recurrent_function).__doc__.lower()


def test_no_host_reads_while_capturing(monkeypatch):
    """Under CUDA-graph capture (or torch.compile) validation must not read tensor values."""
    import gdngen.runtime.validate as validate
    spec, module = _module("gated_delta_rule")
    inputs = make_inputs(spec, lengths=[3, 0, 2], H=1, HV=2, h0=False)
    pool = _pool(2, 16, 16)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    expected = module.fused_recurrent_gated_delta_rule(**inputs, initial_state=pool.clone(), state_indices=slots,
                                                        output_final_state=True)
    monkeypatch.setattr(validate, "values_readable", lambda: False)

    def no_reads(self):
        raise AssertionError("a tensor value was read on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_reads)
    got = module.fused_recurrent_gated_delta_rule(**inputs, initial_state=pool.clone(), state_indices=slots,
                                                   output_final_state=True)
    monkeypatch.undo()
    assert torch.equal(got[0][:, :3], expected[0][:, :3]) and torch.equal(got[1], expected[1])
