"""GPU tier: the forward wy stage's programs per key head (gdngen.runtime.tiles.wy_head_group) on the H200's launch
(one warp, key tiles by TMA): outputs and gradients bit for bit those of one program per value head."""
import importlib

import pytest
import torch

from gdngen.selfcheck import make_inputs
from gdngen.spec import load_spec

pytestmark = pytest.mark.gpu


def _step(module, x):
    x = {n: t.clone().requires_grad_(True) if t is not None else None for n, t in x.items()}
    o, ht = module.chunk_gated_delta_rule(**x, output_final_state=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    torch.autograd.backward([o, ht], [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype),
                                      torch.randn(ht.shape, device="cuda", generator=gen)])
    with torch.no_grad():
        o_nograd, ht_nograd = module.chunk_gated_delta_rule(**x, output_final_state=True)
    return [o, ht, o_nograd, ht_nograd] + [t.grad for t in x.values() if t is not None]


@pytest.mark.parametrize("T", [1000, 4096])
def test_programs_per_key_head_match_programs_per_value_head(T, monkeypatch):
    module = importlib.import_module("generated.gated_delta_rule")
    groups = []
    rule = module.wy_head_group
    monkeypatch.setattr(module, "wy_head_group", lambda config, **kw: groups.append(rule(config, **kw)) or groups[-1])
    x = make_inputs(load_spec("specs/gated_delta_rule.yaml"), B=2, T=T, H=4, HV=8, K=128, V=128,
                    dtype=torch.bfloat16, device="cuda")
    shared = _step(module, x)
    assert 2 in groups
    monkeypatch.setattr(module, "wy_head_group", lambda config, **kw: 1)
    single = _step(module, x)
    for a, b in zip(shared, single):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
