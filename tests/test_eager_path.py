"""Eager calls run the op's own forward/backward through a torch.autograd.Function, not the
torch.library dispatch (which imports torch._dynamo on a process's first call); both paths agree."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import generated.gated_delta_rule as gdn

# CPU tensors through the Triton interpreter, which the test session turns on only without a GPU (conftest.py):
# on the H200 these calls would hand CPU tensors to compiled kernels (stop 40 saw all four fail there)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: CPU tensors under the Triton interpreter")


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K, V = 1, 40, 2, 4, 16, 16
    leaves = [torch.randn(B, T, H, K, generator=gen), F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
              torch.randn(B, T, HV, V, generator=gen), F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2),
              torch.rand(B, T, HV, generator=gen), torch.randn(B, HV, K, V, generator=gen)]
    return [x.requires_grad_(True) for x in leaves]


def _run(chunk_op):
    q, k, v, g, beta, h0 = inputs = _inputs()
    o, ht, *_ = chunk_op(q, k, v, g, beta, h0, None, None, None, 0.25, True, 16, False, False, False, False)
    gen = torch.Generator().manual_seed(1)
    (o * torch.randn(o.shape, generator=gen)).sum().add((ht * torch.randn(ht.shape, generator=gen)).sum()).backward()
    return [o.detach(), ht.detach()] + [x.grad for x in inputs]


def test_eager_function_and_library_op_agree_bitwise():
    eager = _run(gdn._chunk_gated_delta_rule_eager.apply)
    op = _run(gdn._chunk_gated_delta_rule_op)
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, a, b in zip(names, eager, op):
        assert a is not None and torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


def test_public_function_takes_the_eager_path_outside_torch_compile():
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "from generated.gated_delta_rule import chunk_gated_delta_rule\n"
        "q = torch.randn(1, 20, 1, 16, requires_grad=True); k = F.normalize(torch.randn(1, 20, 1, 16), dim=-1)\n"
        "v = torch.randn(1, 20, 1, 16); g = F.logsigmoid(torch.randn(1, 20, 1)); b = torch.rand(1, 20, 1)\n"
        "o, _ = chunk_gated_delta_rule(q, k, v, g, b, chunk_size=16)\n"
        "o.sum().backward()\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dynamo imported: False" in out.stdout, out.stdout


def test_no_grad_calls_run_the_forward_without_function_apply(monkeypatch):
    """Where nothing will differentiate the call the public function skips Function.apply (its per-call
    argument binding and context cost the host ~50 us) and gives the same outputs: bit for bit through
    the same kernels (the output stage, fused_output off), and within float32 rounding through the
    state pass that writes the output itself from the wy stage's scores (the default of such a call:
    other products, other rounding)."""
    from gdngen.runtime import override
    from gdngen.selfcheck import rel_rmse
    q, k, v, g, beta, h0 = _inputs()
    o, ht = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    assert o.grad_fn is not None
    applied = []
    original = gdn._chunk_gated_delta_rule_eager.apply
    monkeypatch.setattr(gdn._chunk_gated_delta_rule_eager, "apply", lambda *a: applied.append(1) or original(*a))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), override("gated_delta_rule", "fused_output", value=False):
            o2, ht2 = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 chunk_size=16)
        assert o2.grad_fn is None and torch.equal(o2, o.detach()) and torch.equal(ht2, ht.detach())
        with mode():
            o2, ht2 = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 chunk_size=16)
        assert o2.grad_fn is None and rel_rmse(o2, o.detach()) < 1e-6 and torch.equal(ht2, ht.detach())
    frozen = [x.detach() for x in (q, k, v, g, beta, h0)]                # grad mode, nothing requires grad
    with override("gated_delta_rule", "fused_output", value=False):
        o3, _ = gdn.chunk_gated_delta_rule(*frozen[:5], initial_state=frozen[5], chunk_size=16)
    assert o3.grad_fn is None and torch.equal(o3, o.detach())
    assert applied == []
    gdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)       # grad mode: through apply
    assert applied == [1]


def test_forward_mode_ad_still_reaches_function_apply():
    """Dual tensors require no grad, and forward-mode AD is on under no_grad too: the call must still meet
    the Function (which has no jvp and says so), never drop the tangent silently."""
    import pytest
    import torch.autograd.forward_ad as fwAD
    q, k, v, g, beta, _ = (x.detach() for x in _inputs())
    for mode in (torch.no_grad, torch.enable_grad):
        with mode(), fwAD.dual_level():
            dual = fwAD.make_dual(q, torch.randn_like(q))
            with pytest.raises(NotImplementedError, match="jvp"):
                gdn.chunk_gated_delta_rule(dual, k, v, g, beta, chunk_size=16)
