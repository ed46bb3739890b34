"""GPU tier: generated chunk kernels at realistic shapes against the float64 reference (run on the H200)."""
import importlib

import pytest
import torch

from gdngen.selfcheck import call, make_inputs, reference_outputs, rel_rmse
from gdngen.spec import load_spec

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def _run(name, dtype, chunk_size=64, **shape):
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=7, **shape)
    options = {"normalize": False} if name == "linear_attn" else {}
    o, ht = call(module, spec, inputs, output_final_state=True, chunk_size=chunk_size, **options)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **options)
    assert rel_rmse(o, o_ref) <= TOL[dtype], rel_rmse(o, o_ref)
    assert rel_rmse(ht, ht_ref) <= TOL[dtype], rel_rmse(ht, ht_ref)


@pytest.mark.parametrize("name", ["linear_attn", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_realistic(name, dtype, chunk_size):
    _run(name, dtype, chunk_size, B=2, T=700, H=4, HV=8, K=128, V=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["dense", "varlen-odd-K-elu"])
def test_linear_attn_normalize(dtype, case):
    """normalize=True (the op's default): the normalizer stage's z per key head, HV = 2 H."""
    spec = load_spec("specs/linear_attn.yaml")
    module = importlib.import_module("generated.linear_attn")
    if case == "dense":
        shape, options = dict(B=2, T=2100, H=4, HV=8, K=128, V=128), {}
    else:
        shape, options = dict(lengths=[0, 1, 63, 64, 65, 700, 0], H=2, HV=4, K=100, V=64), {"feature_map": "elu"}
    inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=9, **shape)
    o, ht = call(module, spec, inputs, output_final_state=True, normalize=True, **options)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, normalize=True, **options)
    assert rel_rmse(o, o_ref) <= TOL[dtype], rel_rmse(o, o_ref)
    assert rel_rmse(ht, ht_ref) <= TOL[dtype], rel_rmse(ht, ht_ref)


@pytest.mark.parametrize("name", ["simple_gla", "gated_delta_rule", "gla", "kda"])
@pytest.mark.parametrize("K,V", [(20, 100), (100, 20), (256, 256), (64, 32), (32, 64), (64, 64), (128, 64), (256, 128)])
def test_head_dims(name, K, V):
    _run(name, torch.bfloat16, 64, B=1, T=300, H=2, HV=4, K=K, V=V)


def test_many_short_sequences():
    lengths = [0, 1, 2, 63, 64, 65] * 40
    _run("gated_delta_rule", torch.bfloat16, 64, lengths=lengths, H=2, HV=4, K=128, V=128)


def test_64bit_offsets():
    """B*T*H*K > 2**31: split the sequence and compare the second half against the state hand-off."""
    from generated.gated_delta_rule import chunk_gated_delta_rule
    T, H, K = 1 << 21, 8, 136          # 2**21 * 8 * 136 > 2**31 elements in q
    torch.manual_seed(0)
    q = torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, H, 16, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda") + 2)
    beta = torch.rand(1, T, H, device="cuda")
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    half = T - 4096
    _, h_mid = chunk_gated_delta_rule(q[:, :half], k[:, :half], v[:, :half], g[:, :half], beta[:, :half],
                                      output_final_state=True)
    o2, ht2 = chunk_gated_delta_rule(q[:, half:], k[:, half:], v[:, half:], g[:, half:], beta[:, half:],
                                     initial_state=h_mid, output_final_state=True)
    assert rel_rmse(o[:, half:], o2) <= 1e-2 and rel_rmse(ht, ht2) <= 1e-2


@pytest.mark.parametrize("name", ["linear_attn", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_realistic(name, dtype):
    """fused_recurrent_* compiled: T=1 decode (T is specialised when it equals 1) and a short prefill."""
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    options = {"normalize": False} if name == "linear_attn" else {}
    for T in (1, 37):
        inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=T, B=4, T=T, H=4, HV=8, K=128, V=128)
        o, ht = getattr(module, spec.recurrent_function)(**inputs, output_final_state=True, **options)
        o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **options)
        assert rel_rmse(o, o_ref) <= TOL[dtype] and rel_rmse(ht, ht_ref) <= TOL[dtype]


def test_recurrent_pool_untouched_slots_bitwise():
    from generated.gated_delta_rule import fused_recurrent_gated_delta_rule
    spec = load_spec("specs/gated_delta_rule.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cuda", B=3, T=1, H=2, HV=4, K=128, V=128, h0=False)
    pool = torch.randn(8, 4, 128, 128, device="cuda")
    before = pool.clone()
    slots = torch.tensor([5, -1, 2], device="cuda", dtype=torch.int32)
    fused_recurrent_gated_delta_rule(**inputs, initial_state=pool, state_indices=slots, output_final_state=True)
    untouched = [i for i in range(8) if i not in (5, 2)]
    assert torch.equal(pool[untouched], before[untouched])
    assert not torch.equal(pool[5], before[5]) and not torch.equal(pool[2], before[2])


def test_recurrent_cuda_graph_capture_replay():
    """One decode step captured in a CUDA graph and replayed equals the eager step, bitwise."""
    from generated.gated_delta_rule import fused_recurrent_gated_delta_rule as step
    spec = load_spec("specs/gated_delta_rule.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cuda", B=8, T=1, H=4, HV=8, K=128, V=128, h0=False)
    pool = torch.randn(16, 8, 128, 128, device="cuda")
    slots = torch.arange(8, device="cuda", dtype=torch.int32)
    expected_pool = pool.clone()
    o_expected, _ = step(**inputs, initial_state=expected_pool, state_indices=slots, output_final_state=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # compile outside the capture
        step(**inputs, initial_state=pool.clone(), state_indices=slots, output_final_state=True)
    torch.cuda.current_stream().wait_stream(side)
    work = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = step(**inputs, initial_state=work, state_indices=slots, output_final_state=True)
    work.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_expected) and torch.equal(work, expected_pool)


@pytest.mark.parametrize("B,H,HV", [(1, 2, 4), (2, 16, 32)])   # few / many programs (float32 intermediates: the T path at both)
def test_float32_intermediates_precision(spec_variant, B, H, HV):
    """dtypes.intermediates: float32 (T, W, U, V_new in float32, tf32x3 dots) against the default, at
    issue #10's precision shape class (bf16, K=V=128, T=4096): lower error, and within the issue's 2e-3 (CPU
    emulation: 1.8e-3; a bf16 output alone costs 1.66e-3)."""
    spec, precise = spec_variant("gated_delta_rule", "f32_intermediates", intermediates="float32")
    base_spec, base = spec_variant("gated_delta_rule", "input", intermediates="input")     # bf16 intermediates
    errors = {}
    for label, (s, module) in {"input": (base_spec, base), "float32": (spec, precise)}.items():
        inputs = make_inputs(s, dtype=torch.bfloat16, device="cuda", seed=4, B=B, T=4096, H=H, HV=HV, K=128, V=128)
        o, ht = call(module, s, inputs, output_final_state=True, chunk_size=64)
        o_ref, ht_ref = reference_outputs(s, inputs, output_final_state=True)
        errors[label] = rel_rmse(o, o_ref), rel_rmse(ht, ht_ref)
    assert errors["float32"][0] < errors["input"][0] and errors["float32"][0] <= 2e-3, errors
    assert errors["float32"][1] <= errors["input"][1], errors


@pytest.mark.parametrize("policy", ["split", "float16"])
@pytest.mark.parametrize("B,H,HV", [(1, 2, 4), (2, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_precise_intermediates_precision(spec_variant, B, H, HV, dtype, fused, policy):
    """dtypes.intermediates: split (the output stage recomputes V_new in float32, 16-bit hi + lo
    products) and float16 (T, X, V_new and the scores in float16) against the default at issue #10's
    precision shape class (K=V=128, T=4096): o within the issue's 2e-3 in bf16 (CPU emulation: 1.75e-3
    both), lower than the default (float16 inputs: split lower, float16 the default's own path).
    ``fused``: both written by the state pass (the split's V_new pair formed there)."""
    spec, split = spec_variant("gated_delta_rule", policy, intermediates=policy)
    base_spec, base = spec_variant("gated_delta_rule", "input", intermediates="input")     # bf16 intermediates
    from gdngen.runtime import override
    errors = {}
    for label, (s, module) in {"input": (base_spec, base), "split": (spec, split)}.items():
        inputs = make_inputs(s, dtype=dtype, device="cuda", seed=4, B=B, T=4096, H=H, HV=HV, K=128, V=128)
        with override(base_spec.name, "store_wu", value=False), \
                override(s.name, "fused_output", value=fused):              # the T path, as split takes
            o, ht = call(module, s, inputs, output_final_state=True, chunk_size=64)
        o_ref, ht_ref = reference_outputs(s, inputs, output_final_state=True)
        errors[label] = rel_rmse(o, o_ref), rel_rmse(ht, ht_ref)
    if policy == "float16" and dtype == torch.float16:
        assert errors["split"] == errors["input"], errors              # float16 inputs: the same kernels' path
        return
    assert errors["split"][0] < errors["input"][0], errors
    if dtype == torch.bfloat16:
        assert errors["split"][0] <= 2e-3, errors
    assert errors["split"][1] <= errors["input"][1] * 1.001, errors     # split: the same state pass; float16: better


@pytest.mark.parametrize("name", ["simple_gla", "gated_delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_pass_in_pieces(name, dtype):
    """One long sequence over few heads: the forward state pass runs in pieces (chosen by the
    default), against float64 and against the unsplit pass."""
    from gdngen.runtime import override
    from gdngen.runtime.tiles import state_pieces, tiles
    shape = dict(B=1, T=8192, H=2, HV=4, K=128, V=128)
    def value_tile(n):
        return tiles(name, "state", K=128, V=128, BT=64, N=n, HV=4, dtype=dtype, H=2, T=8192)["BV"]
    assert state_pieces(name, N=1, HV=4, V=128, T=8192, BT=64, value_tile=value_tile) > 1
    _run(name, dtype, **shape)
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=8, **shape)
    o, ht = call(module, spec, inputs, output_final_state=True)
    with override(name, "state_pieces", value=1):
        o_one, ht_one = call(module, spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_one) <= TOL[dtype] / 10 and rel_rmse(ht, ht_one) <= TOL[dtype] / 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_output_matches_the_output_stage(dtype):
    """A forward nothing differentiates at a long, many-head shape: the state pass writes the output
    from the wy stage's scores (fused_output forced on, in pieces) against the unfused forward and
    float64."""
    from gdngen.runtime import override
    name = "gated_delta_rule"
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=9, B=1, T=8192, H=16, HV=32, K=128, V=128)
    with override(name, "fused_output", value=True):
        o, ht = call(module, spec, inputs, output_final_state=True)
    with override(name, "fused_output", value=False):
        o_unfused, ht_unfused = call(module, spec, inputs, output_final_state=True)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) <= TOL[dtype] and rel_rmse(ht, ht_ref) <= TOL[dtype]
    assert rel_rmse(o, o_unfused) <= TOL[dtype] / 10 and rel_rmse(ht, ht_unfused) <= 1e-6


@pytest.mark.parametrize("name", ["gated_delta_rule", "simple_gla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [8192, 8010])
def test_fused_pass_through_tma_matches_its_pointer_loads(name, dtype, T):
    """The fused state pass with its tiles through TMA descriptors (the 16-bit default on Hopper, forced
    here for float32 too) against the same pass with pointer loads, in pieces; T = 8010 ends each
    sequence in a partial chunk (the descriptors' zero fill stands in for the masks). Bitwise equal,
    and within the dtype's tolerance of float64, on NaN-poisoned buffers."""
    from gdngen.runtime import override
    from gdngen.selfcheck import poisoned_memory
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=17, B=2, T=T, H=8, HV=16, K=128, V=128)
    outputs = {}
    for tma in (False, True):
        with override(name, "fused_output", value=True), override(name, "state_output", TMA=tma), \
                override(name, "gluon_state", value=False), poisoned_memory():      # the Triton pass
            outputs[tma] = call(module, spec, inputs, output_final_state=True)
    (o, ht), (o_tma, ht_tma) = outputs[False], outputs[True]
    assert torch.equal(o_tma, o) and torch.equal(ht_tma, ht)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o_tma, o_ref) <= TOL[dtype] and rel_rmse(ht_tma, ht_ref) <= TOL[dtype]
