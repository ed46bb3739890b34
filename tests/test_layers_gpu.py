"""gdngen.layers on a CUDA GPU at realistic widths: the conv and norm kernels in bf16, the module vs its
float64 reference path, prefill + decode, and transformers' Qwen3-Next patched vs its torch path.

float32 runs are held to float32 accuracy; bf16 to the budget of bf16 inputs and outputs (a bf16
rounding is 2^-8 = 3.9e-3 relative, and the projections and the GDN op each add some).
"""
import copy

import pytest
import torch

from gdngen.layers import (GatedDeltaNet, GatedDeltaNetCache, gated_rms_norm, gated_rms_norm_reference,
                           short_conv, short_conv_reference)
from gdngen.selfcheck import poisoned_memory, rel_rmse

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2


def _randn(*shape, seed, dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("varlen", [False, True])
def test_short_conv_qwen3_next_width_bf16(varlen):
    """D = 2 * 2048 + 4096 channels (Qwen3-Next's q, k, v), W = 4, with conv state, in bf16, forward and backward."""
    D, W = 8192, 4
    B, T = (1, 1500) if varlen else (2, 700)
    cu = torch.tensor([0, 1, 400, 1500], dtype=torch.int32, device="cuda") if varlen else None
    N = 3 if varlen else B
    x = _randn(B, T, D, seed=1, dtype=torch.bfloat16).requires_grad_()
    w = (_randn(D, W, seed=2) * 0.5).bfloat16().requires_grad_()
    h0 = _randn(N, D, W, seed=3, dtype=torch.bfloat16).requires_grad_()
    dy, dht = _randn(B, T, D, seed=4), _randn(N, D, W, seed=5)
    with poisoned_memory():
        (q, k, v), ht = short_conv(x, w, initial_state=h0, cu_seqlens=cu, output_final_state=True,
                                   splits=(2048, 2048, 4096))
        y = torch.cat([q, k, v], -1)
        grads = torch.autograd.grad((y.float() * dy).sum() + (ht.float() * dht).sum(), [x, w, h0])
    leaves = [t.detach().double().requires_grad_() for t in (x, w, h0)]     # float64: no TF32 in cuDNN's conv
    y_ref, ht_ref = short_conv_reference(leaves[0], leaves[1], initial_state=leaves[2], cu_seqlens=cu,
                                         output_final_state=True)
    ref_grads = torch.autograd.grad((y_ref * dy.double()).sum() + (ht_ref * dht.double()).sum(), leaves)
    assert rel_rmse(y, y_ref) < 5e-3 and torch.equal(ht.double(), ht_ref)     # the state is a copy of inputs
    for got, want in zip(grads, ref_grads):
        assert rel_rmse(got, want) < 5e-3


def test_gated_rms_norm_wide_bf16():
    """32 value heads of 128, the gate a slice of the fused projection, bf16, forward and backward."""
    proj = _randn(2, 1024, 3 * 4096, seed=6, dtype=torch.bfloat16).requires_grad_()
    x = _randn(2, 1024, 32, 128, seed=7, dtype=torch.bfloat16).requires_grad_()
    w = (_randn(128, seed=8) * 0.2 + 1).bfloat16().requires_grad_()
    dy = _randn(2, 1024, 32, 128, seed=9)
    with poisoned_memory():
        z = proj[..., 4096:8192].unflatten(-1, (32, 128))
        y = gated_rms_norm(x, z, w, 1e-6)
        grads = torch.autograd.grad((y.float() * dy).sum(), [x, proj, w])
    leaves = [t.detach().double().requires_grad_() for t in (x, proj, w)]
    y_ref = gated_rms_norm_reference(leaves[0], leaves[1][..., 4096:8192].unflatten(-1, (32, 128)), leaves[2], 1e-6)
    ref_grads = torch.autograd.grad((y_ref * dy.double()).sum(), leaves)
    assert rel_rmse(y, y_ref) < 5e-3
    for got, want in zip(grads, ref_grads):
        assert rel_rmse(got, want) < 5e-3


LAYER = dict(hidden_size=512, num_heads=4, num_v_heads=8, head_dim=64, conv_bias=True, layer_idx=0)

# The bf16 layer runs everything in bf16 (projections, conv, norm), so its error vs the float64 module is
# the bf16 rounding of every activation plus the GDN op's own bf16 error.  The same layer with
# kernels="reference" in bf16 (torch, the GDN op in float64 on the bf16 activations) measures the first
# part; by the triangle inequality |gdngen - f64| <= |torch bf16 - f64| + |gdngen - torch bf16|, and the
# second term is the kernels' own error on the same activations, which the op tier bounds for the gate
# gradients at 2e-2 (tests/test_backward_gpu.py TOL["A_log"] / ["dt_bias"]).  That bound is used for
# A_log and dt_bias only; every other tensor keeps BF16_TOL against float64.
#
# Why the gate parameters: their gradients are plain sums, over the B*T = 1400 tokens of a head, of the
# per-token gate gradient c (dt_bias: da; A_log: da * softplus(a + dt_bias) / sigmoid(a + dt_bias)), with no
# random weight to average errors out as x does in the projections' gradients.  Numbers at this test's
# shapes and weights (CPU interpreter with bf16 dots emulated in fp32, two x/dy draws):
#   * per token the kernel is fine: da rel-RMSE 1.49% gdngen vs 1.13% torch bf16, the same x1.3 as for
#     y (1.23% vs 0.90%) and every other tensor;
#   * the sums cancel: sum|c| / |sum c| = 12..15 (rms over heads), and the errors of c are correlated along
#     time (a chunk shares its state and decay; the bf16 A_log, dt_bias are shared by all tokens): per head
#     mean / rms of the da error up to 0.31..0.40 (gdngen), 0.17..0.27 (torch bf16), where independent
#     errors give 1/sqrt(1400) = 0.027, so the error of a sum grows ~N while the sum itself grows ~sqrt(N);
#   * gradient rel-RMSE vs float64, gdngen / torch bf16: A_log 0.0215 / 0.0087 and 0.0178 / 0.0080, dt_bias
#     0.0214 / 0.0065 and 0.0184 / 0.0084; bounds 0.027..0.029.  On the H200 (its x, dy; cuBLAS's bf16
#     matmuls make the torch path noisier there): A_log 0.0232 / 0.0187, dt_bias 0.0240 / 0.0190, bounds
#     0.039; gdngen vs torch bf16 directly 0.0162 / 0.0165, within the op tier's 2e-2;
#   * a wrong kernel: A_log's (or dt_bias's) gradient 5% too large or too small gives 0.040..0.065 on CPU,
#     0.060 / 0.050 on the H200 (5% on one head only: 0.050), over the bound.  The other tensors: gdngen
#     0.0088..0.0150, under BF16_TOL; the torch bf16 path at most 0.0113 for them, and its gate gradients,
#     cancelling as gdngen's do, are held to 2 * BF16_TOL so that the bound stays under 0.06.
GATE_PARAMS = ("A_log", "dt_bias")
GATE_OP_TOL = 2e-2


def _layer_grads(layer, x, dy):
    """{"y", "x.grad", each parameter's name: its gradient} of ``(layer(x) * dy).sum()``."""
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    (y * dy).sum().backward()
    return {"y": y.detach(), "x.grad": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_matches_float64_reference(dtype):
    torch.manual_seed(0)
    ref = GatedDeltaNet(**LAYER, kernels="reference").cuda().double()
    weights = {k: v.float() for k, v in ref.state_dict().items()}
    layer = GatedDeltaNet(**LAYER).cuda()
    layer.load_state_dict(weights)
    layer = layer.to(dtype)
    x64 = _randn(2, 700, 512, seed=10).double()
    dy = _randn(2, 700, 512, seed=11).double()
    want = _layer_grads(ref, x64, dy)
    got = _layer_grads(layer, x64.to(dtype), dy.to(dtype))
    errors = {name: rel_rmse(got[name], want[name]) for name in want}
    if dtype == torch.float32:
        bounds = dict.fromkeys(errors, 1e-4)
    else:
        torch_bf16 = GatedDeltaNet(**LAYER, kernels="reference").cuda()
        torch_bf16.load_state_dict(weights)
        base = _layer_grads(torch_bf16.to(dtype), x64.to(dtype), dy.to(dtype))
        base = {name: rel_rmse(base[name], want[name]) for name in want}
        caps = {name: 2 * BF16_TOL if name in GATE_PARAMS else BF16_TOL for name in base}
        assert all(e < caps[name] for name, e in base.items()), f"the bf16 torch path itself: {base}"
        bounds = {name: base[name] + GATE_OP_TOL if name in GATE_PARAMS else BF16_TOL for name in errors}
    assert set(GATE_PARAMS) <= set(errors)
    bad = {name: (e, bounds[name]) for name, e in errors.items() if not e < bounds[name]}
    assert not bad, f"(error, bound): {bad}; all errors: {errors}"


def test_prefill_then_decode_equals_full_forward():
    torch.manual_seed(1)
    layer = GatedDeltaNet(**LAYER).cuda()
    x = _randn(3, 520, 512, seed=12)
    with torch.no_grad():
        full = layer(x)
        cache = GatedDeltaNetCache()
        pieces = [layer(x[:, :512], cache=cache)]                  # chunk op (longer than the threshold)
        pieces += [layer(x[:, t:t + 1], cache=cache) for t in range(512, 520)]    # the recurrence
    assert rel_rmse(torch.cat(pieces, 1), full) < 1e-5


def _qwen3_next_pair():
    transformers = pytest.importorskip("transformers")
    from gdngen.layers import patch_qwen3_next
    config = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).cuda().eval()
    block = model.model.layers[0].linear_attn
    with torch.no_grad():      # moderate decay (see tests/test_layers_cpu.py::_qwen3_next_pair)
        block.A_log.copy_(torch.linspace(0.1, 1.0, 8).log())
        block.dt_bias.copy_(torch.linspace(-2.0, 0.5, 8))
    patched = copy.deepcopy(model)
    assert patch_qwen3_next(patched) == 1
    return model, patched


def test_qwen3_next_matches_transformers_and_generates_the_same(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)     # transformers' conv1d in true float32
    model, patched = _qwen3_next_pair()
    ids = torch.randint(0, 512, (2, 600), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    ref = model(ids, labels=ids)
    ref.loss.backward()
    out = patched(ids, labels=ids)
    out.loss.backward()
    assert rel_rmse(out.logits, ref.logits) < 1e-4
    ref_params = dict(model.named_parameters())
    for name, p in patched.named_parameters():
        want = ref_params[name].grad
        if want is not None and want.abs().sum() > 0:
            assert rel_rmse(p.grad, want) < 1e-3, name
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids[:, :100], **options), model.generate(ids[:, :100], **options))
