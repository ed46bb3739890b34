"""The generated chunkwise backward (issue #4) against autograd through the float64 reference.

CPU tier: kernels run under the Triton interpreter, so shapes stay small (T <= 50, K, V <= 32,
plus one V = 100 case for odd head dims). Every gradient is compared: q, k, v, g, beta, the
initial state, A_log and dt_bias, with a gradient on the final state too; every buffer the
backward allocates is NaN-poisoned, so an element a kernel forgets to write fails the check.
"""
import dataclasses
import importlib
from unittest import mock

import pytest
import sympy as sp
import torch

from gdngen import reference
from gdngen.algebra import G_LAST, check_chunk_backward, derive, gate_derivatives, l2norm_backward
from gdngen.plan import build_plan
from gdngen.selfcheck import make_inputs, poisoned_memory, rel_rmse
from gdngen.spec import load_spec

FP32_TOL = 1e-4
FP16_TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "initial_state": 8e-3,
            "A_log": 2e-2, "dt_bias": 2e-2}
ALL_FUSED = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 allow_neg_eigval=True)


def _grads(name, *, dtype=torch.float32, options=None, chunk_size=16, final_grad=True, hard_decay=False,
           strong_decay=False, positive_qk=False, seed=0, reference_too=True, **shape):
    """(generated grads, float64 reference grads) by input name, for one random problem (reference_too=False:
    None for the reference's)."""
    options = dict(options or {})
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, dtype=dtype, seed=seed, fused_gate=options.get("use_gate_in_kernel", False),
                         beta_logits=options.get("use_beta_sigmoid_in_kernel", False), **shape)
    if positive_qk:
        # normalised linear attention divides by q . sum(k): positive features (elu + 1 style) keep
        # that away from zero, as the feature maps it is meant for do
        for n in ("q", "k"):
            inputs[n] = torch.nn.functional.elu(inputs[n]) + 1
    if hard_decay:
        # log-decays below the gates stage's floor (-60): a floored value has no gradient
        inputs["g"][:, 3] = -80.0                  # token 3, every head (and key channel)
        inputs["g"][:, -1, 0] = -200.0
    if strong_decay:
        # log-gates down to -20 per token: a chunk's cumsum reaches -1280, so any factoring of
        # exp(g_i - g_j) through a positive exponent overflows; half the channels stay mild
        gen = torch.Generator().manual_seed(seed + 7)
        strong = -20.0 * torch.rand(inputs["g"].shape, generator=gen)
        inputs["g"] = torch.where(torch.arange(inputs["g"].shape[-1]) % 2 == 0, strong.to(inputs["g"].dtype),
                                  inputs["g"])
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    args = {**inputs, **leaves}
    # the float64 replay must not be what answers: make it fail if the op falls back to it
    replay = mock.patch.object(module, "reference_grads", side_effect=AssertionError("fell back to the replay"))
    with poisoned_memory(), replay:
        o, ht = getattr(module, spec.chunk_function)(**args, output_final_state=final_grad,
                                                      chunk_size=chunk_size, **options)
        gen = torch.Generator().manual_seed(seed + 1)
        do = torch.randn(o.shape, generator=gen).to(o.dtype)
        outputs, cotangents = [o], [do]
        if final_grad:
            outputs.append(ht)
            cotangents.append(torch.randn(ht.shape, generator=gen))
        got = torch.autograd.grad(outputs, list(leaves.values()), cotangents)
    if not reference_too:
        return dict(zip(leaves, got)), None

    ref_leaves = {n: x.detach().double().requires_grad_(True) for n, x in leaves.items()}
    ref_args = {**inputs, **ref_leaves}
    positional = [ref_args.pop(n, None) for n in ("q", "k", "v", "g", "beta")]
    ro, rht = reference.run(spec, *positional, form="recurrent", output_final_state=True, **ref_args, **options)
    ref_outputs = [ro] + ([rht] if final_grad else [])
    want = torch.autograd.grad(ref_outputs, list(ref_leaves.values()), [c.double() for c in cotangents])
    return dict(zip(leaves, got)), dict(zip(leaves, want))


def _check(got, want, tol):
    errors = {n: rel_rmse(got[n], want[n]) for n in got}
    limits = {n: tol[n] if isinstance(tol, dict) else tol for n in got}
    bad = {n: f"{e:.2e} > {limits[n]:.0e}" for n, e in errors.items() if not e <= limits[n]}
    assert not bad, f"relative RMSE vs the float64 reference: {bad} (all: {errors})"
    for n in got:
        assert got[n].dtype == want[n].dtype or got[n].dtype != torch.float64, n
        assert torch.isfinite(got[n]).all(), f"{n} has non-finite entries"


FP32_CASES = {
    # additive family
    "linear_attn-normalize-off": ("linear_attn", dict(B=2, T=40, H=2, HV=2, K=16, V=16, options=dict(normalize=False), chunk_size=64)),
    "linear_attn-normalize-varlen": ("linear_attn", dict(lengths=[9, 0, 1, 22], H=1, HV=2, K=16, V=16, h0=False,
                                                         positive_qk=True, options=dict(normalize=True), chunk_size=16)),
    "simple_gla-gva-odd-bt32-floor": ("simple_gla", dict(B=2, T=45, H=1, HV=2, K=20, V=12, chunk_size=32, hard_decay=True)),
    "simple_gla-varlen-bt16": ("simple_gla", dict(lengths=[7, 0, 1, 33], H=1, HV=2, K=16, V=16, chunk_size=16)),
    # delta family
    "gated_delta_rule-varlen-fused-bt16": ("gated_delta_rule", dict(lengths=[7, 0, 1, 33], H=1, HV=2, K=20, V=12,
                                                                   chunk_size=16, options=ALL_FUSED)),
    "gated_delta_rule-dense-bt64": ("gated_delta_rule", dict(B=2, T=50, H=1, HV=2, K=32, V=32, chunk_size=64)),
    "gated_delta_rule-sigmoid-no-h0-no-dht-bt32": ("gated_delta_rule", dict(
        B=1, T=37, H=2, HV=2, K=16, V=16, chunk_size=32, h0=False, final_grad=False,
        options=dict(use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True))),
    "delta_rule-l2norm-v100-bt32": ("delta_rule", dict(B=1, T=35, H=1, HV=2, K=20, V=100, chunk_size=32,
                                                       options=dict(use_qk_l2norm_in_kernel=True,
                                                                    use_beta_sigmoid_in_kernel=True))),
}


@pytest.mark.parametrize("case", list(FP32_CASES))
def test_backward_fp32_matches_reference(case):
    name, kwargs = FP32_CASES[case]
    got, want = _grads(name, **kwargs)
    _check(got, want, FP32_TOL)


@pytest.mark.parametrize("name", ["simple_gla", "gated_delta_rule"])
def test_backward_fp16_matches_reference(name):
    options = ALL_FUSED if name == "gated_delta_rule" else {}
    got, want = _grads(name, dtype=torch.float16, B=1, T=40, H=1, HV=2, K=32, V=32, chunk_size=16, options=options)
    _check(got, want, FP16_TOL)


def test_backward_is_bitwise_reproducible():
    first, _ = _grads("gated_delta_rule", lengths=[7, 0, 1, 25], H=1, HV=2, K=16, V=16, chunk_size=16,
                      options=ALL_FUSED)
    second, _ = _grads("gated_delta_rule", lengths=[7, 0, 1, 25], H=1, HV=2, K=16, V=16, chunk_size=16,
                       options=ALL_FUSED)
    for n in first:
        assert torch.equal(first[n], second[n]), f"{n} differs between two identical runs"


def test_backward_with_a_broadcast_output_gradient():
    """o.sum() hands the backward a stride-0 gradient; the op makes it contiguous."""
    spec = load_spec("specs/simple_gla.yaml")
    module = importlib.import_module("generated.simple_gla")
    inputs = make_inputs(spec, B=1, T=20, H=1, HV=2, K=16, V=16, h0=False)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
    o, _ = module.chunk_simple_gla(**{**inputs, **leaves}, chunk_size=16)
    got = torch.autograd.grad(o.sum(), list(leaves.values()))
    ref = {n: x.detach().double().requires_grad_(True) for n, x in leaves.items()}
    ro, _ = reference.run(spec, ref["q"], ref["k"], ref["v"], ref["g"])
    want = torch.autograd.grad(ro.sum(), list(ref.values()))
    _check(dict(zip(leaves, got)), dict(zip(leaves, want)), FP32_TOL)


def test_backward_plan_covers_none_and_scalar_decay():
    for name in ("linear_attn", "simple_gla", "delta_rule", "gated_delta_rule"):
        plan = build_plan(load_spec(f"specs/{name}.yaml"))
        assert plan.backward_backend == "triton", name
        assert [s.name for s in plan.backward_stages][-2:] in (["chunk", "gates"], ["wy", "gates"],
                                                               ["gates", "l2norm"])
    # per-channel decay: the decayed scores on 16-row blocks (intra, wy_decay stages)
    plan = build_plan(load_spec("specs/gla.yaml"))
    assert plan.backward_backend == "triton"
    assert [s.name for s in plan.backward_stages] == ["intra", "state", "chunk", "gates"]
    plan = build_plan(load_spec("specs/kda.yaml"))
    assert plan.backward_backend == "triton"
    assert [s.name for s in plan.backward_stages] == ["wy_prep", "intra", "state", "chunk", "wy", "wy_decay",
                                                      "gates", "l2norm"]


@pytest.mark.parametrize("decay", ["none", "scalar", "vector"])
@pytest.mark.parametrize("delta", [False, True])
def test_backward_recipe_equals_differentiated_recurrence(decay, delta):
    report = check_chunk_backward(decay, delta, C=3)
    assert report.entries >= 20


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_backward_recipe_check_catches_a_wrong_factor(decay):
    wrong = dataclasses.replace(derive(decay, True), key_update_decay=sp.exp(G_LAST))
    with pytest.raises(AssertionError, match="differentiation gives"):
        check_chunk_backward(decay, True, algebra=wrong)


def test_gate_derivatives_and_l2norm_backward():
    d = gate_derivatives()
    x, a, b = sp.Symbol("x", real=True), sp.Symbol("A_log", real=True), sp.Symbol("b", real=True)
    for name, expr, at in [("decay_dx", d["decay_dx"], {x: 0.3, a: -0.2, sp.Symbol("dt_bias", real=True): 0.1}),
                           ("beta_db", d["beta_db"], {b: 0.7})]:
        value = float(expr.rewrite(sp.exp).subs(at).evalf())
        if name == "decay_dx":
            want = -torch.exp(torch.tensor(-0.2)) * torch.sigmoid(torch.tensor(0.4))
        else:
            want = torch.sigmoid(torch.tensor(0.7)) * (1 - torch.sigmoid(torch.tensor(0.7)))
        assert abs(value - float(want)) < 1e-6, name
    assert l2norm_backward(3).shape == (3, 1)


def test_backward_multi_tile_layouts_with_partial_tiles():
    """Small tiles forced: several key and value tiles per head, the last one partly masked (as
    K=V=256 or V=100 get on the GPU), so a wrong stride, a missing mask or a dg_part slot mix-up
    between key tiles shows at CPU size."""
    from gdngen.runtime import backward_tiles as bt
    module = importlib.import_module("generated.gated_delta_rule")
    seen = []

    def recording(stage, **shape):
        config = bt.backward_tiles(stage, **shape)
        seen.append((stage, config, shape))
        return config

    with bt.override_backward("chunk", BK=16, BV=16), bt.override_backward("wy", BK=16, BV=16), \
            bt.override_backward("intra", BK=16, BV=16), \
            bt.override_backward("wy_prep", BK=16), bt.override_backward("state", BV=16), \
            mock.patch.object(module, "backward_tiles", side_effect=recording):
        got, want = _grads("gated_delta_rule", B=1, T=36, H=1, HV=2, K=40, V=36, chunk_size=16,
                           options=dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True))
    tiles = {stage: (config, shape) for stage, config, shape in seen}
    assert set(tiles) == {"wy_prep", "intra", "state", "chunk", "wy"}
    for stage in ("chunk", "wy", "intra"):
        config, shape = tiles[stage]
        assert -(-shape["K"] // config["BK"]) == 3 and shape["K"] % config["BK"], stage
        assert -(-shape["V"] // config["BV"]) == 3 and shape["V"] % config["BV"], stage
    _check(got, want, FP32_TOL)


PERSISTENT_CASES = {
    "gated_delta_rule-varlen-fused": ("gated_delta_rule", dict(lengths=[7, 0, 1, 33], H=1, HV=2, K=40, V=36,
                                                               chunk_size=16, options=ALL_FUSED)),
    "delta_rule-dense": ("delta_rule", dict(B=1, T=70, H=2, HV=2, K=40, V=16, chunk_size=32)),
    "linear_attn-normalize-varlen": ("linear_attn", dict(lengths=[9, 0, 1, 22], H=1, HV=2, K=40, V=16, h0=False,
                                                         positive_qk=True, options=dict(normalize=True),
                                                         chunk_size=16)),
    # per-channel decay: wy_prep's kernel is shared, its chunk and wy kernels have no persistent grid
    "kda-varlen": ("kda", dict(lengths=[7, 0, 1, 33], H=1, HV=2, K=40, V=16, chunk_size=16)),
}


@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_backward_persistent_grid_matches_one_program_per_tile(case):
    """PERSISTENT (a tile option of the wy_prep, chunk and wy stages): a few programs loop over all the tiles
    (gdngen.runtime.launch.tile_grid; on CPU, PERSISTENT programs). Three key tiles (BK=16 at K=40,
    the last partial) so every index decoded from the flat tile number matters; varlen, where each
    tile finds its own sequence; the gradients bitwise those of one program per tile (whose match
    with the float64 reference the tests above check)."""
    from gdngen.runtime import backward_tiles as bt
    from gdngen.runtime.launch import tile_grid
    name, kwargs = PERSISTENT_CASES[case]
    module = importlib.import_module(f"generated.{name}")
    with bt.override_backward("chunk", BK=16, BV=16):
        per_tile, _ = _grads(name, reference_too=False, **kwargs)
    grids = []

    def recording(config, tiles, device):
        grid, keywords = tile_grid(config, tiles, device)
        grids.append((tiles, grid))
        return grid, keywords

    spec = load_spec(f"specs/{name}.yaml")
    per_channel, delta = spec.transition.decay == "vector", spec.transition.delta
    with bt.override_backward("chunk", BK=16, BV=16, PERSISTENT=0 if per_channel else 3), \
            bt.override_backward("wy", PERSISTENT=0 if per_channel else 2), bt.override_backward("wy_prep", PERSISTENT=4), \
            mock.patch.object(module, "tile_grid", side_effect=recording):
        got, _ = _grads(name, reference_too=False, **kwargs)
    # launch order: wy_prep and wy for the delta rule only, chunk always (after wy for a scalar or no decay,
    # before it for a per-channel one); the per-channel kernels one per tile
    if per_channel:
        want_grids = ([(4,)] if delta else []) + [None] + ([None] if delta else [])
    else:
        want_grids = ([(4,), (2,)] if delta else []) + [(3,)]
    assert [grid if len(grid) == 1 else None for _, grid in grids] == want_grids, grids
    assert all(len(tiles) == len(grid) or tiles[0] * tiles[1] > grid[0] for tiles, grid in grids), grids
    for n in got:
        assert torch.isfinite(got[n]).all() and torch.equal(got[n], per_tile[n]), f"{n}: the persistent grid changed it"


def test_backward_persistent_grid_is_checked():
    from gdngen.runtime.backward_tiles import backward_tiles, override_backward
    from gdngen.runtime.launch import tile_grid
    shape = dict(K=40, V=16, BT=16, N=1, HV=2, dtype=torch.float32)
    with override_backward("state", PERSISTENT=1), pytest.raises(ValueError, match="PERSISTENT.*state"):
        backward_tiles("state", **shape)
    for stage in ("chunk", "wy"):
        with override_backward(stage, PERSISTENT=1), pytest.raises(ValueError, match="PERSISTENT.*per-channel"):
            backward_tiles(stage, **shape, per_channel=True)
    with override_backward("wy_prep", PERSISTENT=1):
        assert backward_tiles("wy_prep", **shape, per_channel=True)["PERSISTENT"] == 1
    for bad in (True, -1, 1.5):
        with override_backward("wy", PERSISTENT=bad), pytest.raises(ValueError, match="PERSISTENT"):
            backward_tiles("wy", **shape)
    with override_backward("wy", PERSISTENT=2):
        assert backward_tiles("wy", **shape)["PERSISTENT"] == 2
    cpu = torch.device("cpu")
    assert tile_grid({"BK": 64}, (2, 3, 4), cpu) == ((2, 3, 4), {"BK": 64})
    assert tile_grid({"BK": 64, "PERSISTENT": 0}, (2, 3, 4), cpu) == ((2, 3, 4), {"BK": 64})
    assert tile_grid({"BK": 64, "PERSISTENT": 5}, (2, 3, 4), cpu) == (
        (5,), {"BK": 64, "PERSISTENT": 5, "N_TILES": 24, "TILES_0": 2, "TILES_1": 3})
    assert tile_grid({"PERSISTENT": 50}, (6, 4), cpu) == ((24,), {"PERSISTENT": 50, "N_TILES": 24, "TILES_0": 6})
    with pytest.raises(ValueError, match="PERSISTENT"):
        tile_grid({"PERSISTENT": -2}, (6, 4), cpu)


@pytest.mark.parametrize("BT", [16, 32, 64])
def test_backward_default_tiles_avoid_the_hopper_miscompile(BT):
    """No 32-wide tile beside a 64-wide chunk (wrong dk/dg at K=20 under Triton 3.6 on the H200,
    as the forward's KNOWN_BAD output tile) where the tile is a product's width; the state pass keeps all K rows and never runs with
    one pipeline stage (illegal memory accesses on the H200)."""
    from gdngen.runtime.backward_tiles import backward_tiles
    for K in (16, 20, 32, 64, 100, 128, 256):
        for V in (16, 32, 64, 100, 128, 256):
            for N, HV in ((1, 4), (2, 8), (4, 16), (16, 32)):
                shape = dict(K=K, V=V, BT=BT, N=N, HV=HV, dtype=torch.bfloat16)
                for stage in ("wy_prep", "intra", "chunk", "wy"):
                    for per_channel in (False, True):
                        config = backward_tiles(stage, **shape, per_channel=per_channel)
                        # intra's key tile is only a contraction width (space.INTRA_MIN_BK)
                        min_bk = 32 if stage == "intra" else 64
                        assert config["BK"] >= min_bk and config.get("BV", 64) >= 64, (stage, shape, config)
                state = backward_tiles("state", **shape)
                assert state["BK"] >= K, (shape, state)
                assert state["num_stages"] >= 2, (shape, state)


def test_backward_tile_override_is_checked():
    from gdngen.runtime.backward_tiles import backward_tiles, override_backward
    shape = dict(K=40, V=16, BT=16, N=1, HV=2, dtype=torch.float32)
    with override_backward("state", BK=32), pytest.raises(ValueError, match="BK"):
        backward_tiles("state", **shape)          # would drop key rows 32..39
    with override_backward("state", num_stages=1), pytest.raises(ValueError, match="num_stages"):
        backward_tiles("state", **shape)
    with override_backward("chunk", BV=24), pytest.raises(ValueError, match="BV"):
        backward_tiles("chunk", **shape)
    with pytest.raises(ValueError, match="stage"):
        with override_backward("output", BK=16):
            pass
    with override_backward("chunk", BK=16):
        assert backward_tiles("chunk", **shape)["BK"] == 16
    assert backward_tiles("chunk", **shape)["BK"] == 64


def test_backward_wide_stage_tiles_below_64_refused_on_gpu(monkeypatch):
    """The tile rule (narrow chunk / wy tiles gave wrong dk and dg on the H200) holds for GPU launches;
    the interpreter keeps accepting them (the multi-tile tests above rely on it)."""
    from gdngen.runtime import backward_tiles as bt
    shape = dict(K=128, V=128, BT=64, N=1, HV=2, dtype=torch.bfloat16)
    monkeypatch.setattr(bt, "_launches_on_gpu", lambda: True)
    for stage in bt.WIDE_STAGES:
        with bt.override_backward(stage, BK=32), pytest.raises(ValueError, match="BK.*>= 64"):
            bt.backward_tiles(stage, **shape)
    with bt.override_backward("chunk", BV=32), pytest.raises(ValueError, match="BV.*>= 64"):
        bt.backward_tiles("chunk", **shape)
    with bt.override_backward("intra", BK=32):          # no [BT, BT] product beside it: allowed
        assert bt.backward_tiles("intra", **shape)["BK"] == 32
    for stage in ("chunk", "wy", "intra", "wy_prep", "state", "wy_decay"):
        config = bt.backward_tiles(stage, **shape)      # every default passes the rule
        assert stage not in bt.WIDE_STAGES or min(config.get("BK", 64), config.get("BV", 64)) >= 64
    monkeypatch.setattr(bt, "_launches_on_gpu", lambda: False)
    with bt.override_backward("chunk", BK=32):
        assert bt.backward_tiles("chunk", **shape)["BK"] == 32


# ---- per-channel (vector) decay: gla and kda. Their scores carry the decay inside the contraction over K,
# built on 16-row blocks so no exponent is positive; strong decay (log-gates to -20 per token)
# must stay finite and accurate.
CHANNEL_FP32_CASES = {
    "gla-gva-odd-bt32-floor": ("gla", dict(B=2, T=45, H=1, HV=2, K=20, V=12, chunk_size=32, hard_decay=True)),
    "gla-varlen-bt16": ("gla", dict(lengths=[7, 0, 1, 33], H=1, HV=2, K=16, V=16, chunk_size=16)),
    "gla-dense-bt64": ("gla", dict(B=1, T=50, H=2, HV=2, K=32, V=32, chunk_size=64)),
    "gla-no-h0-no-dht-bt32": ("gla", dict(B=1, T=37, H=1, HV=2, K=16, V=16, chunk_size=32, h0=False,
                                          final_grad=False)),
    "gla-strong-decay-bt64": ("gla", dict(B=1, T=50, H=1, HV=2, K=16, V=24, chunk_size=64, strong_decay=True)),
    "gla-strong-decay-varlen-bt32": ("gla", dict(lengths=[1, 40, 0, 6], H=1, HV=1, K=20, V=16, chunk_size=32,
                                                 strong_decay=True)),
    "kda-gva-odd-bt32-floor": ("kda", dict(B=2, T=45, H=1, HV=2, K=20, V=12, chunk_size=32, hard_decay=True)),
    "kda-varlen-l2norm-sigmoid-bt16": ("kda", dict(lengths=[7, 0, 1, 33], H=1, HV=2, K=16, V=16, chunk_size=16,
                                                   options=dict(use_qk_l2norm_in_kernel=True,
                                                                use_beta_sigmoid_in_kernel=True))),
    "kda-strong-decay-bt64": ("kda", dict(B=1, T=50, H=2, HV=2, K=32, V=32, chunk_size=64, strong_decay=True)),
    "kda-no-h0-no-dht-strong-varlen-bt32": ("kda", dict(lengths=[1, 40, 0, 6], H=1, HV=1, K=20, V=16,
                                                        chunk_size=32, h0=False, final_grad=False,
                                                        strong_decay=True)),
}


@pytest.mark.parametrize("case", list(CHANNEL_FP32_CASES))
def test_channel_backward_fp32_matches_reference(case):
    name, kwargs = CHANNEL_FP32_CASES[case]
    got, want = _grads(name, **kwargs)
    _check(got, want, FP32_TOL)


@pytest.mark.parametrize("name,strong_decay", [("gla", False), ("gla", True), ("kda", True)])
def test_channel_backward_fp16_matches_reference(name, strong_decay):
    options = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True) if name == "kda" else {}
    got, want = _grads(name, dtype=torch.float16, B=1, T=40, H=1, HV=2, K=32, V=32, chunk_size=16,
                       strong_decay=strong_decay, options=options)
    _check(got, want, FP16_TOL)


@pytest.mark.parametrize("name", ["gla", "kda"])
def test_channel_backward_is_bitwise_reproducible(name):
    shape = dict(lengths=[7, 0, 1, 25], H=1, HV=2, K=16, V=16, chunk_size=16, strong_decay=True)
    first, _ = _grads(name, **shape)
    second, _ = _grads(name, **shape)
    for n in first:
        assert torch.equal(first[n], second[n]), f"{n} differs between two identical runs"


@pytest.mark.parametrize("name", ["gla", "kda"])
def test_channel_backward_multi_tile_layouts(name):
    """Several key and value tiles per head, the last partly masked: key tiles own disjoint
    channels of the per-channel dg slots, value tiles accumulate dP."""
    from gdngen.runtime import backward_tiles as bt
    with bt.override_backward("chunk", BK=16, BV=16), bt.override_backward("intra", BK=16, BV=16), \
            bt.override_backward("state", BV=16), bt.override_backward("wy", BK=16, BV=16), \
            bt.override_backward("wy_prep", BK=16), bt.override_backward("wy_decay", BK=16):
        got, want = _grads(name, B=1, T=36, H=1, HV=2, K=40, V=36, chunk_size=32, strong_decay=True)
    _check(got, want, FP32_TOL)


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_sum_head_groups_matches_a_float64_sum(groups):
    """dq / dk of grouped value heads: each query head's group summed (fixed order, one rounding
    for two terms, float32 accumulation beyond), as the float64 sum rounded to the dtype; through
    the kernel (the interpreter made to round bf16 as the GPU does) and through torch."""
    from gdngen.bf16_emulation import patch_bf16_interpreter
    from gdngen.runtime.head_groups import sum_head_groups
    from gdngen.runtime.ops import sum_head_groups_torch
    x = torch.randn(2, 5, 3 * groups, 8, generator=torch.Generator().manual_seed(groups)).bfloat16()
    want = x.double().view(2, 5, 3, groups, 8).sum(3)
    undo = patch_bf16_interpreter()
    try:
        by_kernel = sum_head_groups(x, 3)
    finally:
        undo()
    for got in (by_kernel, sum_head_groups_torch(x, 3)):
        assert got.shape == (2, 5, 3, 8) and got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sum_head_groups_kernel_is_the_torch_sum_bit_for_bit(groups, dtype):
    """The kernel (the backward's dq and dk) gives torch's strided sums bit for bit, into a given
    output (a view of a larger buffer, as the time segments pass) and into a new tensor, with K not
    a power of two and a partial last row block, and only reads its input; a strided output takes
    the torch path; a wrong output or head count is refused by name."""
    from gdngen.bf16_emulation import patch_bf16_interpreter
    from gdngen.runtime.head_groups import sum_head_groups
    from gdngen.runtime.ops import sum_head_groups_torch
    x = torch.randn(2, 37, 3 * groups, 40, generator=torch.Generator().manual_seed(7 * groups)).to(dtype)
    want = sum_head_groups_torch(x.clone(), 3)
    full = torch.full((1, 50, 3, 40), float("nan"), dtype=dtype)
    given = x.clone()
    undo = patch_bf16_interpreter()
    try:
        new = sum_head_groups(x, 3)
        into = sum_head_groups(x[1:], 3, out=full[:, 3:40])
        strided = sum_head_groups(x, 3, out=torch.empty(2, 37, 6, 40, dtype=dtype)[:, :, ::2])
    finally:
        undo()
    assert torch.equal(new, want) and torch.equal(strided, want) and not strided.is_contiguous()
    assert into.data_ptr() == full[:, 3:40].data_ptr() and torch.equal(into, want[1:])
    assert full[:, :3].isnan().all() and full[:, 40:].isnan().all()      # nothing written outside out
    assert torch.equal(x, given)
    with pytest.raises(ValueError, match="out"):
        sum_head_groups(x, 3, out=torch.empty(2, 37, 3, 41, dtype=dtype))
    with pytest.raises(ValueError, match="H"):
        sum_head_groups(x, 4 if groups == 3 else 5)


