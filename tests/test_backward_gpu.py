"""GPU tier of the generated chunkwise backward (issue #4): bf16 at a realistic shape against autograd
through the float64 reference (run on the H200)."""
import importlib

import pytest
import torch

from gdngen.selfcheck import gradient_errors, make_inputs
from gdngen.spec import load_spec

pytestmark = pytest.mark.gpu
# the tolerances for bf16: dq/dk/dv (and dh0) 8e-3, gate and beta gradients 2e-2
TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2,
       "dt_bias": 2e-2}
FUSED = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


# Gradients known to miss the bar: (spec, sorted options) whose dq is reported as an expected failure
# that fails the test the day it meets the bar (so this list is kept honest). Empty now. It held
# linear_attn normalize=True (identity and elu+1) from stop 22 (issue #7): bf16 dq 1.06e-2 / 1.87e-2 at
# (2, 2048, 4, 8), K = V = 128 on the H200, the main op's dq and the normaliser's summed as two
# bf16-rounded terms that nearly cancel. Branch la-dq folds the normaliser's term into the chunk
# backward in float32 (c = dO . o recomputed in float32): the bf16-faithful CPU interpreter gives
# 3.9e-3 / 6.7e-3 at this very shape (and 3.8e-3 / 6.7e-3 at (1, 1024, 2, 4), K = V = 64, where the old
# code gave 1.06e-2 / 1.82e-2: tests/test_bf16_emulation_cpu.py, benchmarks/la_dq_error.py). The H200
# confirmed it at stop 23: this test passes, and benchmarks/grad_error.py at (2, 2048, 8, 8) gives 3.91e-3 /
# 6.58e-3 (FLA on the same inputs: 1.11e-2 / 2.04e-2).
KNOWN_DQ_GAP: set = set()


def _check_grads(name, options, chunk_size=64, spec=None, module=None, **shape):
    errors = gradient_errors(name, options, chunk_size=chunk_size, dtype=torch.bfloat16, device="cuda",
                             fused_gate=options.get("use_gate_in_kernel", False),
                             beta_logits=options.get("use_beta_sigmoid_in_kernel", False), spec=spec,
                             module=module, **shape)
    errors.pop("o")
    known_gap = (name, tuple(sorted(options.items()))) in KNOWN_DQ_GAP
    bad = {n: e for n, e in errors.items() if not e <= TOL[n] and not (known_gap and n == "q")}
    assert not bad, f"{name} {options}: {bad} (all: {errors})"
    if known_gap:
        assert not errors["q"] <= TOL["q"], f"dq {errors['q']:.3g} now meets the bar: drop {name} {options} from KNOWN_DQ_GAP"
        pytest.xfail(f"known gap: bf16 dq {errors['q']:.3g} > {TOL['q']} (normalize=True, see KNOWN_DQ_GAP)")


@pytest.mark.parametrize("name,options", [
    ("gated_delta_rule", {}),
    ("gated_delta_rule", FUSED),
    ("simple_gla", {}),
    ("delta_rule", {"use_qk_l2norm_in_kernel": True}),
    ("gla", {}),
    ("kda", {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}),
    ("linear_attn", {"normalize": True}),
    ("linear_attn", {"normalize": True, "feature_map": "elu"}),
], ids=["gdn", "gdn-fused", "simple_gla", "delta_rule-l2norm", "gla", "kda-fused", "linear_attn-normalize",
        "linear_attn-normalize-elu"])
def test_backward_bf16_realistic(name, options):
    _check_grads(name, options, B=2, T=2048, H=4, HV=8, K=128, V=128)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_backward_bf16_chunk_sizes_varlen(chunk_size):
    _check_grads("gated_delta_rule", {}, chunk_size=chunk_size, lengths=[1, 0, 700, 63, 64, 65, 300], H=2, HV=4,
                 K=128, V=128)


@pytest.mark.parametrize("K,V", [(20, 100), (256, 256), (64, 32)])
def test_backward_bf16_head_dims(K, V):
    _check_grads("gated_delta_rule", {}, B=1, T=300, H=2, HV=4, K=K, V=V)


@pytest.mark.parametrize("options", [{}, FUSED], ids=["plain", "fused"])
def test_backward_float16_intermediates_gpu(spec_variant, options):
    """dtypes.intermediates: float16 (the forward keeps T and V_new in float16 for the backward, whose
    kernels round them to the gradients' dtype on load): every bf16 gradient within the tier's bars."""
    spec, module = spec_variant("gated_delta_rule", "float16", intermediates="float16")
    _check_grads(spec.name, options, spec=spec, module=module, B=2, T=2048, H=4, HV=8, K=128, V=128)


def test_backward_bitwise_repeat_gpu():
    spec = load_spec("specs/gated_delta_rule.yaml")
    module = importlib.import_module("generated.gated_delta_rule")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cuda", seed=5, B=2, T=1024, H=4, HV=8, K=128, V=128)
    runs = []
    for _ in range(2):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
                  if isinstance(x, torch.Tensor) and x.is_floating_point()}
        o, _ = module.chunk_gated_delta_rule(**{**inputs, **leaves})
        o.float().square().sum().backward()
        runs.append([x.grad for x in leaves.values()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("config", [
    dict(chunk=dict(BK=64, BV=128, PERSISTENT=1), wy=dict(PERSISTENT=1, num_stages=1), wy_prep=dict(PERSISTENT=2)),
    dict(chunk=dict(BK=64, BV=64, num_warps=8, PERSISTENT=1), wy=dict(num_warps=8, PERSISTENT=2, num_stages=1),
         wy_prep=dict(PERSISTENT=4)),
])
def test_backward_persistent_grid_matches_one_program_per_tile_gpu(config):
    """The wy_prep, chunk and wy stages' persistent grid (PERSISTENT programs per SM looping over the tiles, the
    pipeliner loading a tile ahead) against one program per tile at the same tiles, bf16, several chunks per
    program, a varlen batch included (every tile finds its own sequence). Not bitwise on the H200: the looped
    kernel compiles to another float32 summation order (stop 31: at most 2e-6 on gradients of ~100), so each
    gradient must agree to 1e-5 of its largest entry, far inside bf16's 4e-3 and far below what a tile read
    from the wrong sequence or head would move."""
    from gdngen.runtime.backward_tiles import override_backward
    spec = load_spec("specs/gated_delta_rule.yaml")
    module = importlib.import_module("generated.gated_delta_rule")
    for shape in (dict(B=2, T=4096, H=4, HV=8, K=128, V=128), dict(lengths=[1000, 1, 0, 2989, 64], H=2, HV=4, K=128, V=128)):
        inputs = make_inputs(spec, dtype=torch.bfloat16, device="cuda", seed=7, **shape)
        runs = []
        for persistent in (False, True):
            tiles = {stage: {k: v for k, v in c.items() if persistent or k != "PERSISTENT"} for stage, c in config.items()}
            leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
                      if isinstance(x, torch.Tensor) and x.is_floating_point()}
            with override_backward("chunk", **tiles["chunk"]), override_backward("wy", **tiles["wy"]), \
                    override_backward("wy_prep", **tiles["wy_prep"]):
                o, _ = module.chunk_gated_delta_rule(**{**inputs, **leaves})
                o.float().square().sum().backward()
            runs.append({n: x.grad for n, x in leaves.items()})
        for n in runs[0]:
            assert torch.isfinite(runs[1][n]).all(), n
            scale = runs[0][n].abs().max().item()
            assert scale > 0, n
            diff = (runs[0][n] - runs[1][n]).abs().max().item()
            assert diff <= 1e-5 * scale, f"{shape} {n}: the persistent grid moved the gradient by {diff} (max {scale})"
