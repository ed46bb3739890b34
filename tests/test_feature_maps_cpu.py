"""Feature maps φ on q and k (``feature_map=``): kernels against the float64 reference (interpreter).

Element-wise maps (identity, elu+1, relu) are applied inside the chunk and recurrent kernels;
random features (Performer, K -> m) by their own stage. Gradients: the generated backward on
φ(q), φ(k) with φ's chain rule in torch, checked against autograd through the reference.
"""
import importlib
import importlib.util
import sys

import pytest
import sympy as sp
import torch

from gdngen import reference
from gdngen.algebra import feature_maps
from gdngen.render import render_module
from gdngen.runtime.validate import validate_feature_map
from gdngen.selfcheck import poisoned_memory, rel_rmse
from gdngen.spec import load_spec, spec_from_dict

SPEC = load_spec("specs/linear_attn.yaml")
MAPS = ["identity", "elu+1", "relu", "random_features"]
M_FEATURES = 24        # m != K: the state's key dimension changes with random features


def _module():
    return importlib.import_module("generated.linear_attn")


def _inputs(B=2, T=37, H=2, HV=4, K=16, V=16, *, lengths=None, fmap="identity", h0=True, seed=0):
    """Float32 inputs; q, k shifted positive so that relu leaves normalisers well away from zero."""
    gen = torch.Generator().manual_seed(seed)
    cu_seqlens = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    N = B if lengths is None else len(lengths)
    q = torch.randn(B, T, H, K, generator=gen) + 0.5
    k = torch.randn(B, T, H, K, generator=gen) + 0.5
    v = torch.randn(B, T, HV, V, generator=gen)
    projection = 0.4 * torch.randn(M_FEATURES, K, generator=gen) if fmap == "random_features" else None
    KS = M_FEATURES if projection is not None else K
    initial_state = torch.randn(N, HV, KS, V, generator=gen) if h0 else None
    return dict(q=q, k=k, v=v, initial_state=initial_state, cu_seqlens=cu_seqlens,
                feature_map=fmap, feature_projection=projection)


def _reference(inputs, **options):
    args = dict(inputs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return reference.run(SPEC, q, k, v, output_final_state=True, **args, **options)


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("normalize", [False, True])
def test_chunk_and_recurrent_forward_match_reference(fmap, normalize):
    mod = _module()
    inputs = _inputs(fmap=fmap, seed=MAPS.index(fmap))
    o_ref, ht_ref = _reference(inputs, normalize=normalize)
    with poisoned_memory():
        o, ht = mod.chunk_linear_attn(**inputs, output_final_state=True, normalize=normalize, chunk_size=16)
        o_rec, ht_rec = mod.fused_recurrent_linear_attn(**inputs, output_final_state=True, normalize=normalize)
    KS = M_FEATURES if fmap == "random_features" else 16
    assert ht.shape == (2, 4, KS, 16) and ht_rec.shape == ht.shape
    for name, got, want in (("o", o, o_ref), ("ht", ht, ht_ref), ("o_rec", o_rec, o_ref), ("ht_rec", ht_rec, ht_ref)):
        assert rel_rmse(got, want) <= 1e-5, f"{name}: {rel_rmse(got, want):.3e}"
    # chunk == decode up to float32 rounding
    assert rel_rmse(o, o_rec.double()) <= 1e-5


@pytest.mark.parametrize("fmap", ["elu+1", "random_features"])
def test_varlen_odd_head_dims(fmap):
    """Padded K lanes and rows past a sequence end: elu+1 maps 0 to 1, so the kernels must re-mask."""
    mod = _module()
    inputs = _inputs(lengths=[7, 0, 1, 20], H=1, HV=2, K=20, V=12, fmap=fmap, seed=5)
    o_ref, ht_ref = _reference(inputs, normalize=True)
    with poisoned_memory():
        o, ht = mod.chunk_linear_attn(**inputs, output_final_state=True, chunk_size=16)
        o_rec, ht_rec = mod.fused_recurrent_linear_attn(**inputs, output_final_state=True)
    for got, want in ((o, o_ref), (ht, ht_ref), (o_rec, o_ref), (ht_rec, ht_ref)):
        assert rel_rmse(got, want) <= 1e-5


@pytest.mark.parametrize("fmap", ["elu+1", "relu", "random_features"])
@pytest.mark.parametrize("normalize", [False, True])
def test_gradients_match_reference(fmap, normalize):
    mod = _module()
    inputs = _inputs(B=1, T=37, H=1, HV=2, fmap=fmap, seed=11)
    names = ["q", "k", "v", "initial_state"] + (["feature_projection"] if fmap == "random_features" else [])
    leaves = {n: inputs[n].clone().requires_grad_() for n in names}
    o, ht = mod.chunk_linear_attn(**{**inputs, **leaves}, output_final_state=True, normalize=normalize, chunk_size=16)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    ref_leaves = {n: inputs[n].double().requires_grad_() for n in names}
    o_ref, ht_ref = _reference({**inputs, **ref_leaves}, normalize=normalize)
    ref_grads = torch.autograd.grad((o_ref, ht_ref), list(ref_leaves.values()), (do.double(), dht.double()))
    for name, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-4, f"d{name}: {rel_rmse(got, want):.3e}"


def test_recurrent_state_pool_has_feature_dimension():
    """With random features the pool's key dimension is m; decode twice == one call over both tokens."""
    mod = _module()
    inputs = _inputs(B=2, T=2, H=1, HV=2, fmap="random_features", h0=False, seed=3)
    q, k, v, W = inputs["q"], inputs["k"], inputs["v"], inputs["feature_projection"]
    pool = torch.zeros(3, 2, M_FEATURES, 16)
    slots = torch.tensor([2, 0])
    for t in range(2):
        mod.fused_recurrent_linear_attn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=pool,
                                        state_indices=slots, feature_map="random_features", feature_projection=W,
                                        normalize=False)
    _, ht_ref = _reference(inputs, normalize=False)
    assert rel_rmse(pool[slots], ht_ref) <= 1e-5
    with pytest.raises(ValueError, match="initial_state"):
        mod.fused_recurrent_linear_attn(q, k, v, initial_state=torch.zeros(3, 2, 16, 16), state_indices=slots,
                                        feature_map="random_features", feature_projection=W, normalize=False)


def test_elu_alias_and_identity_default():
    mod = _module()
    inputs = _inputs(T=9, fmap="elu+1")
    o1, _ = mod.chunk_linear_attn(**inputs, normalize=False)
    o2, _ = mod.chunk_linear_attn(**{**inputs, "feature_map": "elu"}, normalize=False)
    assert torch.equal(o1, o2)
    plain = {**inputs, "feature_map": None}
    o3, _ = mod.chunk_linear_attn(**plain, normalize=False)
    o4, _ = mod.chunk_linear_attn(**{**plain, "feature_map": "identity"}, normalize=False)
    assert torch.equal(o3, o4) and not torch.allclose(o1, o3)


@pytest.mark.parametrize("fn", ["chunk_linear_attn", "fused_recurrent_linear_attn"])
def test_bad_feature_map_arguments(fn):
    op = getattr(_module(), fn)
    inputs = _inputs(T=5, fmap="random_features", h0=False)
    base = {k: inputs[k] for k in ("q", "k", "v")}
    W = inputs["feature_projection"]
    cases = [
        (dict(feature_map="softmax"), ValueError, "feature_map"),
        (dict(feature_map=3), TypeError, "feature_map"),
        (dict(feature_map="random_features"), ValueError, "feature_projection"),
        (dict(feature_map="random_features", feature_projection=W[:, :8]), ValueError, "feature_projection"),
        (dict(feature_map="random_features", feature_projection=torch.zeros(300, 16)), ValueError, "feature_projection"),
        (dict(feature_map="random_features", feature_projection=W[0]), ValueError, "feature_projection"),
        (dict(feature_map="random_features", feature_projection=W.long()), TypeError, "feature_projection"),
        (dict(feature_map="relu", feature_projection=W), ValueError, "feature_projection"),
        (dict(feature_map="random_features", feature_projection=W, initial_state=torch.zeros(2, 4, 16, 16)),
         ValueError, "initial_state"),
    ]
    for options, error, name in cases:
        with pytest.raises(error, match=name):
            op(**base, **options)


def test_reference_and_validation_reject_undeclared_maps():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="feature_map"):
        reference.run(SPEC, q, k, v, feature_map="gelu")
    with pytest.raises(ValueError, match="feature_projection"):
        reference.run(SPEC, q, k, v, feature_map="random_features")
    info = {"name": "only_relu", "feature_maps": ["identity", "relu"], "max_k": 256}
    assert validate_feature_map(info, "relu", None, q) == ("relu", 8)
    assert validate_feature_map(info, None, None, q) == ("identity", 8)
    with pytest.raises(ValueError, match="feature_map"):
        validate_feature_map(info, "elu", None, q)
    gla = load_spec("specs/gla.yaml")      # declares no feature maps
    with pytest.raises(ValueError, match="feature_map"):
        reference.run(gla, q, k, v, torch.zeros(1, 4, 1, 8), feature_map="relu")


def test_printed_maps_agree_with_the_oracle():
    """The algebra's f(x) (what the kernels print) equals gdngen.reference.apply_feature_map."""
    x = torch.linspace(-30.0, 30.0, 241, dtype=torch.float64)
    for name in ("identity", "elu+1", "relu"):
        f = sp.lambdify(feature_maps.X, feature_maps.elementwise(name), "math")
        got = torch.tensor([float(f(float(t))) for t in x], dtype=torch.float64)
        assert torch.allclose(got, reference.apply_feature_map(name, x), rtol=1e-12, atol=1e-12), name
    rf = sp.lambdify((feature_maps.P, feature_maps.NORM, feature_maps.M), feature_maps.random_features(), "math")
    xs, W = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    want = reference.apply_feature_map("random_features", xs, W)
    got = torch.tensor([[rf(float(xs[r] @ W[i]), float(0.5 * xs[r] @ xs[r]), 3.0) for i in range(3)] for r in range(5)],
                       dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12)


def test_vector_decay_spec_with_feature_maps(tmp_path):
    """A spec outside the catalogue: per-channel decay (the blocked output kernel) with relu / elu+1."""
    spec = spec_from_dict({"name": "gla_mapped", "transition": {"decay": "vector", "delta": False},
                           "feature_maps": ["identity", "relu", "elu+1"], "chunk": {"sizes": [16], "default": 16}})
    path = tmp_path / "gla_mapped.py"
    path.write_text(render_module(spec))
    loader = importlib.util.spec_from_file_location("gla_mapped_test_module", path)
    mod = importlib.util.module_from_spec(loader)
    sys.modules[loader.name] = mod
    loader.loader.exec_module(mod)
    gen = torch.Generator().manual_seed(2)
    B, T, H, K, V = 1, 21, 1, 16, 16
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0)
    for fmap in ("relu", "elu+1"):
        o, ht = mod.chunk_gla_mapped(q, k, v, g, output_final_state=True, feature_map=fmap)
        o_rec, _ = mod.fused_recurrent_gla_mapped(q, k, v, g, feature_map=fmap)
        o_ref, ht_ref = reference.run(spec, q, k, v, g, output_final_state=True, feature_map=fmap)
        assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5 and rel_rmse(o_rec, o_ref) <= 1e-5
    with pytest.raises(ValueError, match="feature_map"):
        mod.chunk_gla_mapped(q, k, v, g, feature_map="random_features")
