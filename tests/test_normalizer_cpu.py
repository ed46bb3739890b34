"""The normalizer stage of linear attention (normalize=True): its op against a float64 cumsum formula,
and the chunk function's normalised outputs and gradients against the float64 reference.

z_t = scale * phi(q_t) . sum_{s<=t} phi(k_s) per key head, restarting at every sequence start.
CPU tier (Triton interpreter): small shapes, but past one 64-token step and one 32-channel key tile
so that the scan's carry and the key tiles' sum are exercised.
"""
import importlib

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from gdngen import reference
from gdngen.selfcheck import make_inputs, poisoned_memory, rel_rmse
from gdngen.spec import load_spec

SPEC = load_spec("specs/linear_attn.yaml")
CODES = {"identity": 0, "elu+1": 1, "relu": 2}


def _module():
    return importlib.import_module("generated.linear_attn")


def _z_formula(q, k, cu_seqlens, scale, fmap):
    """float64 z by torch.cumsum per sequence (dense: every batch row is one)."""
    fq, fk = reference.apply_feature_map(fmap, q), reference.apply_feature_map(fmap, k)
    if cu_seqlens is None:
        return scale * (fq * fk.cumsum(1)).sum(-1)
    offsets = cu_seqlens.tolist()
    running = torch.cat([fk[:, bos:eos].cumsum(1) for bos, eos in zip(offsets, offsets[1:])], dim=1)
    return scale * (fq * running).sum(-1)


CASES = {
    # name: (B, T, H, K, lengths, feature map)
    "dense-odd-K": (2, 37, 2, 20, None, "identity"),
    "dense-two-key-tiles-elu": (2, 70, 1, 40, None, "elu+1"),
    "varlen-empty-elu": (1, None, 2, 20, [9, 0, 1, 70, 0], "elu+1"),
    "varlen-relu": (1, None, 1, 32, [64, 3], "relu"),
}


@pytest.mark.parametrize("step", [None, 16], ids=["default-step", "16-token-steps"])
@pytest.mark.parametrize("case", list(CASES))
def test_normalizer_op_matches_cumsum_formula(case, step, monkeypatch):
    """z, d/dq and d/dk of the op (eager path) against autograd through the float64 formula; every
    buffer the op allocates is NaN-poisoned, so a row or key lane a kernel skips fails. With the
    shipped step (256 tokens) these sequences fit one step; 16-token steps make the carry cross steps."""
    mod = _module()
    if step is not None:
        monkeypatch.setattr(mod, "_NORMALIZER_BT", step)
    B, T, H, K, lengths, fmap = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    cu_seqlens = None
    if lengths is not None:
        T = sum(lengths)
        cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    # shifted positive, as the normaliser's inputs are in use (positive features)
    q = torch.randn(B, T, H, K, generator=gen) + 0.5
    k = torch.randn(B, T, H, K, generator=gen) + 0.5
    scale = 0.3
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    z_ref = _z_formula(q64, k64, cu_seqlens, scale, fmap)
    dz = torch.randn(z_ref.shape, generator=gen)
    dq_ref, dk_ref = torch.autograd.grad(z_ref, (q64, k64), dz.double())

    q32, k32 = q.clone().requires_grad_(), k.clone().requires_grad_()
    with poisoned_memory():
        z = mod._chunk_linear_attn_normalizer_eager.apply(q32, k32, cu_seqlens, scale, CODES[fmap])
        dq, dk = torch.autograd.grad(z, (q32, k32), dz)
    assert z.shape == (B, T, H) and z.dtype == torch.float32
    for name, got, want in (("z", z, z_ref), ("dq", dq, dq_ref), ("dk", dk, dk_ref)):
        assert rel_rmse(got, want) <= 1e-5, f"{name}: {rel_rmse(got, want):.3e}"


def test_normalizer_backward_op_returns_only_what_is_needed():
    mod = _module()
    gen = torch.Generator().manual_seed(3)
    q, k = torch.rand(1, 10, 1, 16, generator=gen), torch.rand(1, 10, 1, 16, generator=gen)
    dz = torch.randn(1, 10, 1, generator=gen)
    dq, dk = mod._chunk_linear_attn_normalizer_backward_op(dz, q, k, None, 1.0, 0, False, True)
    assert dq.numel() == 0 and dk.shape == k.shape


def test_normalizer_op_opcheck():
    """Schema, fake tensor and autograd registration of the normaliser op (varlen with an empty sequence)."""
    _module()
    gen = torch.Generator().manual_seed(4)
    q = (torch.rand(1, 12, 2, 16, generator=gen) + 0.1).requires_grad_()
    k = (torch.rand(1, 12, 2, 16, generator=gen) + 0.1).requires_grad_()
    cu_seqlens = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    torch.library.opcheck(torch.ops.gdngen.chunk_linear_attn_normalizer, (q, k, cu_seqlens, 0.25, 1))


@pytest.mark.parametrize("lengths", [None, [40, 0, 33]], ids=["dense", "varlen"])
def test_normalized_output_and_gradients_with_grouped_value_heads(lengths):
    """HV = 2 H (each key head's z divides two value heads through a view) and T past one step."""
    mod = _module()
    inputs = make_inputs(SPEC, B=2, T=73, H=2, HV=4, K=20, V=12, lengths=lengths, h0=True, seed=8)
    inputs = {n: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for n, x in inputs.items()}
    names = ["q", "k", "v", "initial_state"]
    leaves = {n: inputs[n].clone().requires_grad_() for n in names}
    with poisoned_memory():
        o, ht = mod.chunk_linear_attn(**{**inputs, **leaves}, output_final_state=True, normalize=True,
                                      feature_map="elu", chunk_size=16)
        gen = torch.Generator().manual_seed(1)
        do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
        grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    ref_leaves = {n: inputs[n].double().requires_grad_() for n in names}
    ref_inputs = {**inputs, **ref_leaves}
    o_ref, ht_ref = reference.run(SPEC, ref_inputs.pop("q"), ref_inputs.pop("k"), ref_inputs.pop("v"),
                                  output_final_state=True, normalize=True, feature_map="elu+1", **ref_inputs)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5
    ref_grads = torch.autograd.grad((o_ref, ht_ref), list(ref_leaves.values()), (do.double(), dht.double()))
    for name, got, want in zip(names, grads, ref_grads):
        assert rel_rmse(got, want) <= 1e-4, f"d{name}: {rel_rmse(got, want):.3e}"


def test_normalized_output_half_precision():
    """16-bit inputs: o divided by z rounded to o's dtype stays within the 16-bit forward bar (5e-3)."""
    mod = _module()
    inputs = make_inputs(SPEC, B=1, T=70, H=1, HV=2, K=16, V=16, h0=False, seed=2)
    args = {n: x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for n, x in inputs.items()}
    o, _ = mod.chunk_linear_attn(**args, normalize=True, chunk_size=16)
    o_ref, _ = reference.run(SPEC, args.pop("q"), args.pop("k"), args.pop("v"), normalize=True, **args)
    assert o.dtype == torch.float16
    assert rel_rmse(o, o_ref) <= 5e-3, f"o: {rel_rmse(o, o_ref):.3e}"


class _TinyNormalizedAttention(torch.nn.Module):
    """Linear projections -> chunk_linear_attn(normalize=True, elu+1, HV = 2 H) -> a scalar."""

    def __init__(self, D=24, H=1, K=16, V=16):
        super().__init__()
        self.H, self.K, self.V = H, K, V
        self.q = torch.nn.Linear(D, H * K)
        self.k = torch.nn.Linear(D, H * K)
        self.v = torch.nn.Linear(D, 2 * H * V)

    def forward(self, x, cu_seqlens=None):
        from generated.linear_attn import chunk_linear_attn
        B, T, _ = x.shape
        o, _ = chunk_linear_attn(self.q(x).view(B, T, self.H, self.K), self.k(x).view(B, T, self.H, self.K),
                                 self.v(x).view(B, T, 2 * self.H, self.V), cu_seqlens=cu_seqlens,
                                 normalize=True, feature_map="elu", chunk_size=16)
        return (o * o).sum()


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compile_fullgraph_normalized_matches_eager(varlen):
    """torch.compile(fullgraph=True) traces the chunk op and the normaliser op (no graph break)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyNormalizedAttention()
    x, cu_seqlens = (torch.randn(1, 30, 24), torch.tensor([0, 11, 11, 30])) if varlen else (torch.randn(2, 20, 24), None)
    loss = model(x, cu_seqlens)
    loss.backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    counters = torch._dynamo.utils.counters
    counters.clear()
    seen = []
    boxed = lambda gm, _: make_boxed_func(gm)      # noqa: E731  (aot_eager, recording what dynamo captured)

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss_c = compiled(x, cu_seqlens)
    loss_c.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert sum("gdngen.chunk_linear_attn_normalizer" in t for t in seen) == 1, seen
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    for (pname, p), gr in zip(model.named_parameters(), eager):
        torch.testing.assert_close(p.grad, gr, rtol=1e-5, atol=1e-5, msg=lambda m: f"{pname}: {m}")


def test_normalized_gradients_without_dq():
    """q not differentiated: the chunk op's backward skips the normaliser's dq term (it is dq's alone)
    and the normaliser op, on a detached q, still gives dk's term."""
    mod = _module()
    inputs = make_inputs(SPEC, B=1, T=70, H=1, HV=2, K=16, V=16, seed=5)
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("k", "v", "initial_state")}
    o, _ = mod.chunk_linear_attn(**{**inputs, **leaves}, normalize=True, chunk_size=16)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(o, list(leaves.values()), do)
    ref = {n: inputs[n].double().requires_grad_() for n in leaves}
    args = {**inputs, **ref}
    o_ref, _ = reference.run(SPEC, args.pop("q"), args.pop("k"), args.pop("v"), normalize=True, **args)
    want = torch.autograd.grad(o_ref, list(ref.values()), do.double())
    for name, a, b in zip(leaves, got, want):
        assert rel_rmse(a, b) <= 1e-5, f"d{name}: {rel_rmse(a, b):.3e}"


def test_normalized_output_under_no_grad_matches_the_autograd_path(monkeypatch):
    """Under no_grad the chunk op and the normaliser skip their Functions' apply: same bits."""
    mod = _module()
    inputs = make_inputs(SPEC, B=1, T=40, H=1, HV=2, K=16, V=16, h0=True, seed=3)
    leaves = {n: x.float().requires_grad_() for n, x in inputs.items() if n in ("q", "k", "v")}
    args = {**inputs, **leaves}
    o, ht = mod.chunk_linear_attn(**args, output_final_state=True, normalize=True, feature_map="elu", chunk_size=16)
    for name in ("_chunk_linear_attn_eager", "_chunk_linear_attn_normalizer_eager"):
        monkeypatch.setattr(getattr(mod, name), "apply", lambda *a: pytest.fail("apply under no_grad"))
    with torch.no_grad():
        o2, ht2 = mod.chunk_linear_attn(**args, output_final_state=True, normalize=True, feature_map="elu",
                                        chunk_size=16)
    assert torch.equal(o2, o.detach()) and torch.equal(ht2, ht.detach())
