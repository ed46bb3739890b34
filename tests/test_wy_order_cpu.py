"""The forward wy stage's program order: value heads that share a key head are neighbouring programs (so the
second finds the chunk's key tile in L2), and every (chunk, sequence, value head) is still taken exactly once."""
import importlib

import pytest
import torch
import triton
import triton.language as tl

module = importlib.import_module("generated.gated_delta_rule")
_group_major = module._group_major


@triton.jit
def _order_kernel(out, H: tl.constexpr, HV: tl.constexpr):
    i_t, i_b, i_hv = _group_major(tl.program_id(0), tl.program_id(1), H, HV)
    launch = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out + launch * 3 + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, i_t,
             tl.where(tl.arange(0, 4) == 1, i_b, i_hv)), mask=tl.arange(0, 4) < 3)


@pytest.mark.parametrize("NT,B,H,HV", [(3, 2, 2, 6), (5, 1, 3, 3), (1, 3, 1, 4), (4, 2, 2, 4)])
def test_group_major_order(NT, B, H, HV):
    out = torch.full((NT * B * HV, 3), -1, dtype=torch.int32)
    _order_kernel[(NT, B * HV)](out, H=H, HV=HV)
    taken = [tuple(r) for r in out.tolist()]     # in launch order
    assert sorted(taken) == [(t, b, hv) for t in range(NT) for b in range(B) for hv in range(HV)]
    G = HV // H
    for first in range(0, len(taken), G):        # each run of G launches: one chunk, one key head
        run = taken[first:first + G]
        assert {(t, b, hv // G) for t, b, hv in run} == {run[0][:2] + (run[0][2] // G,)}
        assert sorted(hv % G for _, _, hv in run) == list(range(G))
