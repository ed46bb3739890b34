"""The wy stage's triangular solve runs its products at TF32 (or on float16 operands) only where its result is rounded to 16 bits."""
import importlib

import pytest
import torch

from gdngen.runtime import solve_precision
from gdngen.selfcheck import make_inputs
from gdngen.spec import catalogue, load_spec


def test_rule():
    assert solve_precision(torch.bfloat16, torch.bfloat16) == "tf32"
    # a float16 result (dtypes.intermediates: float16) rounds the operands to float16: tf32's mantissa
    assert solve_precision(torch.float16, torch.float16) == "fp16"
    assert solve_precision(torch.bfloat16, torch.float16) == "fp16"
    # a float32 result keeps exact float32 products, whatever the inputs
    assert solve_precision(torch.bfloat16, torch.float32) == "ieee"
    assert solve_precision(torch.float32, torch.float32) == "ieee"


@pytest.mark.parametrize("name", ["gated_delta_rule", "kda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wy_launches_carry_the_rule(name, dtype, wy_launches):
    """Every wy launch of a forward and backward passes SOLVE_PRECISION by the dtype of what it writes
    (T, or W when the stage writes W and U)."""
    spec = next(s for s in (load_spec(p) for p in catalogue()) if s.name == name)
    module = importlib.import_module(f"generated.{name}")
    seen = wy_launches(module)
    inputs = make_inputs(spec, B=1, T=40, H=2, HV=2, K=32, V=32, dtype=dtype, h0=True)
    for x in inputs.values():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)
    o, ht = getattr(module, spec.chunk_function)(**inputs, output_final_state=True, chunk_size=16)
    (o.sum() + ht.sum()).backward()
    assert seen
    for args, kwargs in seen:
        tmat, w = args[6], args[7]          # (q, k, k_desc, v, beta, g_cum, tmat, w, ...)
        written = tmat if tmat is not None else w
        assert kwargs["SOLVE_PRECISION"] == solve_precision(dtype, written.dtype)
    if dtype == torch.float32:
        assert {kw["SOLVE_PRECISION"] for _, kw in seen} == {"ieee"}
    else:
        assert {kw["SOLVE_PRECISION"] for _, kw in seen} & {"tf32", "fp16"}


@pytest.mark.parametrize("name", ["gated_delta_rule", "delta_rule", "kda"])
def test_float16_solve_matches_the_reference(name, wy_launches):
    """float16 inputs write a float16 T, so the solve runs on float16 operands ("fp16"): on the x @ y^T
    products of one warp (scalar decay) and on the plain ones (per-channel decay, four warps). Chunk 64
    (four blocks: the deepest block recursion) and a partial last chunk; every output within the
    16-bit bar against the float64 reference."""
    from gdngen.selfcheck import reference_outputs, rel_rmse
    spec = next(s for s in (load_spec(p) for p in catalogue()) if s.name == name)
    module = importlib.import_module(f"generated.{name}")
    seen = wy_launches(module)
    inputs = make_inputs(spec, B=1, T=150, H=1, HV=2, K=32, V=32, dtype=torch.float16, h0=True, seed=5)
    o, ht = getattr(module, spec.chunk_function)(**inputs, output_final_state=True, chunk_size=64)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert {kw["SOLVE_PRECISION"] for _, kw in seen} == {"fp16"}
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rmse(o, o_ref) < 5e-3 and rel_rmse(ht, ht_ref) < 5e-3


@pytest.mark.parametrize("name", ["gated_delta_rule", "delta_rule", "kda"])
def test_float16_solve_out_of_range_chunk_takes_tf32(name):
    """beta = 1.9 (allow_neg_eigval's range) over keys repeated across each 16-token block: the powers of
    a diagonal block of A reach ~1e5, past float16's 65504, so float16 operands gave inf and NaN outputs.
    Such a chunk (|A_ij| > 1 on a diagonal block) solves in tf32: the output stays finite and within
    reach of the float32 path's own error on the same data (this chunked form loses accuracy as beta
    grows past 1: ~5e-3 in float32 here)."""
    from gdngen.selfcheck import reference_outputs, rel_rmse
    spec = next(s for s in (load_spec(p) for p in catalogue()) if s.name == name)
    module = importlib.import_module(f"generated.{name}")
    errors = {}
    for dtype in (torch.float32, torch.float16):
        inputs = make_inputs(spec, B=1, T=64, H=1, HV=2, K=32, V=32, dtype=dtype, h0=False, seed=1)
        gen = torch.Generator().manual_seed(0)
        keys = torch.nn.functional.normalize(torch.randn(1, 4, 1, 1, 32, generator=gen), dim=-1)
        inputs["k"] = keys.expand(1, 4, 16, 1, 32).reshape(1, 64, 1, 32).to(dtype).contiguous()
        inputs["beta"] = torch.full_like(inputs["beta"], 1.9)
        if inputs.get("g") is not None:
            inputs["g"] = torch.full_like(inputs["g"], -0.1)
        o, ht = getattr(module, spec.chunk_function)(**inputs, output_final_state=True, chunk_size=64)
        o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(ht).all(), dtype
        errors[dtype] = max(rel_rmse(o, o_ref), rel_rmse(ht, ht_ref))
    assert errors[torch.float16] < 2 * errors[torch.float32] + 1e-3, errors
