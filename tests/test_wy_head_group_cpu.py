"""The forward wy stage's programs per key head (gdngen.runtime.tiles.wy_head_group): grouped value heads take the
chunk's key products K K^T from one program, which gives what one program per value head gives, bit for bit."""
import importlib

import pytest
import torch

from gdngen.bf16_emulation import patch_bf16_interpreter
from gdngen.runtime.tiles import override, wy_head_group
from gdngen.selfcheck import make_inputs, reference_outputs, rel_rmse
from gdngen.spec import load_spec

ONE_WARP = {"BK": 64, "num_warps": 1, "num_stages": 2}


def test_the_rule():
    half = dict(key_dtype=torch.bfloat16, t_dtype=torch.float16, store_wu=False, store_scores=False)
    assert wy_head_group(ONE_WARP, H=16, HV=32, **half) == 2
    assert wy_head_group(ONE_WARP, H=2, HV=8, **half) == 1                        # groups of four: not measured
    assert wy_head_group(ONE_WARP, H=32, HV=32, **half) == 1                      # no group
    assert wy_head_group(dict(ONE_WARP, num_warps=2), H=16, HV=32, **half) == 1   # measured on one warp only
    assert wy_head_group(ONE_WARP, H=16, HV=32, **dict(half, store_wu=True)) == 1
    assert wy_head_group(ONE_WARP, H=16, HV=32, **dict(half, store_scores=True)) == 1
    assert wy_head_group(ONE_WARP, H=16, HV=32, **dict(half, key_dtype=torch.float32)) == 1
    assert wy_head_group(ONE_WARP, H=16, HV=32, **dict(half, t_dtype=torch.float32)) == 1   # the backward's recomputed T


@pytest.mark.parametrize("name", ["gated_delta_rule", "delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
def test_grouped_heads_share_the_key_gram(name, dtype, varlen, monkeypatch, wy_launches):
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    launches = wy_launches(module)
    lengths = [150, 70] if varlen else None
    inputs = make_inputs(spec, B=2, T=150, H=2, HV=4, K=32, V=32, dtype=dtype, seed=3, lengths=lengths)
    undo = patch_bf16_interpreter() if dtype == torch.bfloat16 else (lambda: None)
    try:
        # T alone: this few heads would take W and U (tiles.store_wu), and the Triton pass that writes the output
        # would take the wy stage's scores too (the Gluon pass forms its own)
        with override(spec.name, "store_wu", value=False), override(spec.name, "fused_output", value=False):
            o, ht = getattr(module, spec.chunk_function)(**inputs, output_final_state=True, chunk_size=64)
            shared = len(launches)
            # the same call with one program per value head
            monkeypatch.setattr(module, "wy_head_group", lambda config, **kw: 1)
            o1, ht1 = getattr(module, spec.chunk_function)(**inputs, output_final_state=True, chunk_size=64)
    finally:
        undo()
    B = 1 if varlen else 2
    grids = module._WY_FAST[64].grids               # (chunk size 64: the only wy launcher these calls use)
    seen = [(grid, kwargs["G_SHARE"]) for grid, (_, kwargs) in zip(grids, launches)]
    assert len(grids) == len(launches) and shared and len(seen) > shared
    assert all(g == 2 and grid[1] == B * 2 for grid, g in seen[:shared]), seen
    assert all(g == 1 and grid[1] == B * 4 for grid, g in seen[shared:]), seen
    assert torch.equal(o, o1) and torch.equal(ht, ht1)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) < 5e-3 and rel_rmse(ht, ht_ref) < 5e-3
