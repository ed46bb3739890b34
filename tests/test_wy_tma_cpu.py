"""The forward wy stage's key tiles through a host TMA descriptor (16-bit inputs, BK dividing K): taken where the
tiles ask, and the same outputs and gradients as the pointer loads, a partial chunk reading the next sequence's
rows included."""
import importlib

import pytest
import torch

from gdngen.runtime.tiles import default_tiles, override
from gdngen.selfcheck import make_inputs, reference_outputs, rel_rmse
from gdngen.spec import catalogue, load_spec


def _descriptors(args):
    return [a for a in args if type(a).__name__ == "TensorDescriptor"]


def test_tiles_ask_for_tma_on_16_bit_inputs_only():
    sizes = dict(K=128, V=128, BT=64, N=4, HV=32)
    assert default_tiles("wy", dtype=torch.bfloat16, **sizes)["TMA"] is True
    assert "TMA" not in default_tiles("wy", dtype=torch.float32, **sizes)
    assert "TMA" not in default_tiles("wy", dtype=torch.bfloat16, per_channel=True, **sizes)


def test_launches_that_write_w_and_u_or_solve_in_float32_take_two_warps():
    """One warp for T alone in fp16 or tf32 (GDN's measured default); two where the stage writes W and U or solves
    in float32 (one warp spilled 516-1688 B offline, stop 56) and for float32 inputs."""
    sizes = dict(K=128, V=128, BT=64, N=4, HV=32)
    warps = {(solve, wu): default_tiles("wy", dtype=torch.bfloat16, solve=solve, writes_wu=wu, **sizes)["num_warps"]
             for solve in (None, "fp16", "tf32", "ieee") for wu in (False, True)}
    assert warps == {(None, False): 1, ("fp16", False): 1, ("tf32", False): 1, ("ieee", False): 2,
                     (None, True): 2, ("fp16", True): 2, ("tf32", True): 2, ("ieee", True): 2}
    assert default_tiles("wy", dtype=torch.float32, **sizes)["num_warps"] == 2


def _run(module, spec, inputs, seen):
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    args = dict(inputs, **leaves)
    o, ht = getattr(module, spec.chunk_function)(**args, output_final_state=True, chunk_size=64)
    gen = torch.Generator().manual_seed(3)
    (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().backward()
    return o, ht, {n: x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("name", ["gated_delta_rule", "delta_rule"])
def test_tma_key_tiles_match_the_pointer_loads(name, wy_launches):
    spec = next(s for s in (load_spec(p) for p in catalogue()) if s.name == name)
    module = importlib.import_module(f"generated.{name}")
    seen = wy_launches(module)
    # two sequences of 150 tokens: the first one's last chunk (22 rows) reads 42 rows of the second by TMA
    inputs = make_inputs(spec, B=2, T=150, H=1, HV=2, K=32, V=32, dtype=torch.float16, h0=True, seed=11)
    o, ht, grads = _run(module, spec, inputs, seen)
    assert seen and all(kw.get("TMA") is True and len(_descriptors(args)) == 1 for args, kw in seen)
    seen.clear()
    with override(spec.name, "wy", TMA=False):
        o_ptr, ht_ptr, grads_ptr = _run(module, spec, inputs, seen)
    assert seen and all(not kw.get("TMA") and not _descriptors(args) for args, kw in seen)
    assert torch.equal(o, o_ptr) and torch.equal(ht, ht_ptr)
    for n in grads:
        assert torch.equal(grads[n], grads_ptr[n]), n
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) < 5e-3 and rel_rmse(ht, ht_ref) < 5e-3


def test_tma_is_dropped_where_bk_does_not_divide_k(wy_launches):
    """K = 48 with BK = 64: a [BT, 64] box would read the next head's columns, so the pointer loads run."""
    spec = next(s for s in (load_spec(p) for p in catalogue()) if s.name == "gated_delta_rule")
    module = importlib.import_module("generated.gated_delta_rule")
    seen = wy_launches(module)
    inputs = make_inputs(spec, B=1, T=70, H=2, HV=2, K=48, V=32, dtype=torch.float16, h0=True, seed=2)
    o, ht = getattr(module, spec.chunk_function)(**inputs, output_final_state=True, chunk_size=64)
    assert seen and all(not kw.get("TMA") and not _descriptors(args) for args, kw in seen)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) < 5e-3 and rel_rmse(ht, ht_ref) < 5e-3


@pytest.mark.parametrize("name, dtype", [("gated_delta_rule", torch.float16), ("delta_rule", torch.bfloat16)])
def test_each_launch_asks_the_warps_of_what_it_writes(name, dtype, wy_launches):
    """The forward passes what the stage writes and its solve precision to the tiles: T alone (GDN's float16 T,
    delta_rule's bf16 T) keeps one warp; delta_rule's W and U with few heads (tiles.store_wu) and the backward's
    float32 T (ieee) take two."""
    spec = next(s for s in (load_spec(p) for p in catalogue()) if s.name == name)
    module = importlib.import_module(f"generated.{name}")
    seen = wy_launches(module)
    inputs = make_inputs(spec, B=1, T=128, H=1, HV=2, K=32, V=32, dtype=dtype, h0=True, seed=5)
    _run(module, spec, inputs, seen)
    with override(spec.name, "store_wu", value=False):
        _run(module, spec, inputs, seen)
    assert seen
    for _, kw in seen:
        assert kw["num_warps"] == (2 if kw["STORE_WU"] or kw["SOLVE_PRECISION"] == "ieee" else 1), kw
    if name == "delta_rule":
        kinds = {(kw["STORE_WU"], kw["SOLVE_PRECISION"]) for _, kw in seen}
        assert {(True, "tf32"), (False, "tf32"), (False, "ieee")} <= kinds, kinds
