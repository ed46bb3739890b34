"""gdngen.layers under the interpreter: short conv and gated RMSNorm kernels vs torch, the GatedDeltaNet
module vs its float64 reference path, the generation cache, padded == packed, and transformers'
Qwen3-Next on gdngen kernels vs its own PyTorch path (skipped only when transformers is absent).

Tiny sizes: the interpreter runs every Triton program in Python.
"""
import copy

import pytest
import torch

from gdngen.layers import (GatedDeltaNet, GatedDeltaNetCache, gated_rms_norm, gated_rms_norm_reference,
                           short_conv, short_conv_reference)
from gdngen.selfcheck import poisoned_memory, rel_rmse

LAYER = dict(hidden_size=32, num_heads=2, num_v_heads=4, head_dim=16, layer_idx=0)


def _f64(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _leaf(x, dtype=torch.float32):
    return None if x is None else x.detach().to(dtype).requires_grad_()


# ---- short convolution -----------------------------------------------------------------------

CONV_CASES = {
    # name: (B, T, D, W, lengths or None, initial state, bias, splits, activation)
    "dense_state_bias": (2, 37, 24, 4, None, True, True, None, "silu"),
    "varlen_empty_short_splits": (1, 40, 24, 4, [3, 0, 1, 36], True, False, (8, 8, 8), "silu"),
    "varlen_no_state_two_splits": (1, 23, 20, 3, [2, 21], False, True, (16, 4), "silu"),
    "decode_T1": (3, 1, 20, 4, None, True, True, None, "silu"),
    "W1_no_activation": (2, 9, 10, 1, None, True, True, None, None),
    # longer than one backward tile (64 rows owning 64 - W + 1 under the interpreter): the overlap
    "multi_tile_state_bias": (2, 150, 24, 4, None, True, True, None, "silu"),
    "multi_tile_W8_varlen": (1, 170, 20, 8, [5, 130, 35], True, True, (8, 12), "silu"),
    "multi_tile_W2_no_activation": (1, 140, 16, 2, None, False, False, None, None),
    # split boundaries on channel-block boundaries (128 under the interpreter): one load/store per block
    "aligned_splits": (2, 130, 384, 4, None, False, False, (128, 128, 128), "silu"),
    "aligned_two_splits_varlen_state": (1, 100, 384, 4, [70, 30], True, True, (256, 128), "silu"),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_short_conv_matches_torch(case):
    """Outputs, final state and the gradients of x, weight, bias and the initial state, in float32."""
    B, T, D, W, lengths, use_h0, use_bias, splits, act = CONV_CASES[case]
    cu = None if lengths is None else torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    N = B if lengths is None else len(lengths)
    wide = _f64(B, T, D + 5, seed=1)
    x64 = wide[..., 2:D + 2]                     # a channel slice: read in place through its row stride
    w64, b64 = _f64(D, W, seed=2, scale=0.5), _f64(D, seed=3) if use_bias else None
    h64 = _f64(N, D, W, seed=4) if use_h0 else None
    dy, dht = _f64(B, T, D, seed=5), _f64(N, D, W, seed=6)

    leaves64 = [_leaf(t, torch.float64) for t in (wide, w64, b64, h64)]
    y_ref, ht_ref = short_conv_reference(leaves64[0][..., 2:D + 2], leaves64[1], leaves64[2], activation=act,
                                         cu_seqlens=cu, initial_state=leaves64[3], output_final_state=True)
    ref_grads = torch.autograd.grad((y_ref * dy).sum() + (ht_ref * dht).sum(), [t for t in leaves64 if t is not None])

    leaves = [_leaf(t) for t in (wide, w64, b64, h64)]
    with poisoned_memory():
        y, ht = short_conv(leaves[0][..., 2:D + 2], leaves[1], leaves[2], activation=act, cu_seqlens=cu,
                           initial_state=leaves[3], output_final_state=True, splits=splits)
    if splits is not None:
        assert all(part.is_contiguous() for part in y)
        y = torch.cat(y, dim=-1)
    assert y.dtype == torch.float32 and ht.shape == (N, D, W)
    assert rel_rmse(y, y_ref) < 1e-6 and rel_rmse(ht, ht_ref) < 1e-6
    with poisoned_memory():
        grads = torch.autograd.grad((y * dy.float()).sum() + (ht * dht.float()).sum(),
                                    [t for t in leaves if t is not None])
    for got, want in zip(grads, ref_grads):
        assert rel_rmse(got, want) < 1e-5, (got, want)


def test_short_conv_chained_calls_equal_one_call():
    """Carrying the conv state across calls (prefill, then single tokens) equals one call, in place too."""
    x = _f64(2, 11, 12, seed=7).float()
    w = _f64(12, 4, seed=8).float()
    y_full, h_full = short_conv(x, w, output_final_state=True)
    y0, state = short_conv(x[:, :2], w, output_final_state=True)       # shorter than the window
    pieces = [y0]
    for t in range(2, 11):
        y_t, state = short_conv(x[:, t:t + 1], w, initial_state=state, output_final_state=True)
        pieces.append(y_t)
    assert rel_rmse(torch.cat(pieces, 1), y_full) < 1e-6
    assert torch.equal(state, h_full)


# ---- gated RMSNorm ----------------------------------------------------------------------------

NORM_CASES = {
    "silu_4d": dict(shape=(2, 5, 4, 16)),
    "sigmoid_2d": dict(shape=(37, 16), activation="sigmoid"),
    "no_gate": dict(shape=(3, 7, 2, 16), gate=False),
    "no_weight_V24": dict(shape=(3, 7, 2, 24), weight=False),
    "gate_is_a_projection_slice": dict(shape=(2, 5, 4, 16), strided=True),
}


@pytest.mark.parametrize("case", list(NORM_CASES))
def test_gated_rms_norm_matches_torch(case):
    opts = NORM_CASES[case]
    shape, act = opts["shape"], opts.get("activation", "silu")
    V, G = shape[-1], shape[-2]
    x64 = _f64(*shape, seed=1)
    z64 = _f64(*shape[:-2], 3 * G * V, seed=2) if opts.get("strided") else _f64(*shape, seed=2)
    w64 = _f64(V, seed=3) * 0.2 + 1
    dy = _f64(*shape, seed=4)

    def run(fn, dtype):
        x, z, w = _leaf(x64, dtype), _leaf(z64, dtype), _leaf(w64, dtype)
        gate = z[..., G * V:2 * G * V].unflatten(-1, (G, V)) if opts.get("strided") else z
        gate = gate if opts.get("gate", True) else None
        weight = w if opts.get("weight", True) else None
        y = fn(x, gate, weight, 1e-5, act)
        leaves = [t for t, used in ((x, True), (z, gate is not None), (w, weight is not None)) if used]
        return y, torch.autograd.grad((y * dy.to(dtype)).sum(), leaves)

    y_ref, g_ref = run(gated_rms_norm_reference, torch.float64)
    with poisoned_memory():
        y, grads = run(gated_rms_norm, torch.float32)
    assert rel_rmse(y, y_ref) < 1e-6
    for got, want in zip(grads, g_ref):
        assert rel_rmse(got, want) < 1e-6


def test_gated_rms_norm_writes_dgate_into_a_projection_slice():
    """dgate_into: the gate's gradient lands in place in a head slice of a wider [B, T, N] buffer."""
    B, T, G, V = 2, 5, 4, 16
    x64, z64, w64, dy = _f64(B, T, G, V, seed=31), _f64(B, T, G, V, seed=32), _f64(V, seed=33), _f64(B, T, G, V, seed=34)
    refs = [_leaf(t, torch.float64) for t in (x64, z64, w64)]
    g_ref = torch.autograd.grad((gated_rms_norm_reference(*refs, 1e-5) * dy).sum(), refs)
    buf = torch.full((B, T, 3 * G * V), float("nan"))
    target = buf[..., G * V:2 * G * V].view(B, T, G, V)
    x, z, w = (_leaf(t) for t in (x64, z64, w64))
    with poisoned_memory():
        y = gated_rms_norm(x, z, w, 1e-5, dgate_into=lambda: target)
    grads = torch.autograd.grad((y * dy.float()).sum(), [x, z, w])
    assert grads[1].data_ptr() == target.data_ptr() and grads[1].stride() == target.stride()
    for got, want in zip(grads, g_ref):
        assert rel_rmse(got, want) < 1e-6
    assert torch.isnan(buf[..., :G * V]).all() and torch.isnan(buf[..., 2 * G * V:]).all()


# ---- bad arguments ----------------------------------------------------------------------------

def test_bad_arguments_name_the_argument():
    x = torch.randn(1, 8, 6)
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(5, 4))
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(6, 9))                  # window above MAX_WIDTH
    with pytest.raises(ValueError, match="initial_state"):
        short_conv(x, torch.randn(6, 4), initial_state=torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        short_conv(x, torch.randn(6, 4), cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="splits"):
        short_conv(x, torch.randn(6, 4), splits=(2, 2))
    with pytest.raises(ValueError, match="activation"):
        short_conv(x, torch.randn(6, 4), activation="gelu")
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(1, 8, 5), None)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(x, None, torch.randn(5))
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(**LAYER, mode="fast")
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(hidden_size=32, num_heads=2, num_v_heads=3, head_dim=16)
    layer = GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="layer_idx"):
        layer(torch.randn(1, 4, 32), cache=GatedDeltaNetCache())
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(1, 4, 31))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 4, 32), attention_mask=torch.ones(2, 3))


# ---- the GatedDeltaNet module ------------------------------------------------------------------

def _pair(seed=0, **options):
    """A float32 gdngen-kernel layer and the same weights on the float64 reference path."""
    torch.manual_seed(seed)
    layer = GatedDeltaNet(**LAYER, **options)
    with torch.no_grad():       # a conv bias and a non-trivial norm weight, so their gradients are checked too
        layer.norm_weight.uniform_(0.5, 1.5)
    ref = GatedDeltaNet(**LAYER, **options, kernels="reference").double()
    ref.load_state_dict({name: p.double() for name, p in layer.state_dict().items()})
    return layer, ref


def test_module_forward_backward_match_float64_reference():
    layer, ref = _pair(conv_bias=True, chunk_size=16)      # T = 40: two full chunks and a partial one
    x64 = _f64(2, 40, 32, seed=11)
    dy = _f64(2, 40, 32, seed=12)
    x, xr = _leaf(x64), _leaf(x64, torch.float64)
    y, y_ref = layer(x), ref(xr)
    assert rel_rmse(y, y_ref) < 1e-5
    (y * dy.float()).sum().backward()
    (y_ref * dy).sum().backward()
    assert rel_rmse(x.grad, xr.grad) < 1e-5
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert rel_rmse(p.grad, ref_params[name].grad) < 1e-5, name


@pytest.mark.parametrize("options", [dict(conv_bias=True), dict(use_gate=False), dict(conv_bias=True, masked=True)])
def test_module_backward_writes_the_projection_gradient_in_place(monkeypatch, options):
    """Training: the projections as two products (conv input; z | a | b); the gated norm writes dz into
    the second one's gradient buffer in place (a, b are copied in); x and every parameter gradient
    equal float64's, over several conv tiles (T = 150) and through a second backward of the graph."""
    from gdngen.layers import gated_deltanet as module
    options = dict(options)
    masked = options.pop("masked", False)
    layer, ref = _pair(chunk_size=64, **options)
    seen = []
    original = module._Projection.in_place
    monkeypatch.setattr(module._Projection, "in_place",
                        staticmethod(lambda g, target: seen.append(original(g, target)) or seen[-1]))
    B, T = 2, 150
    x64, dy = _f64(B, T, 32, seed=41), _f64(B, T, 32, seed=42)
    mask = None
    if masked:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, :17] = 0
    x, xr = _leaf(x64), _leaf(x64, torch.float64)
    y, y_ref = layer(x, attention_mask=mask), ref(xr, attention_mask=mask)
    assert rel_rmse(y, y_ref) < 1e-5
    (y_ref * dy).sum().backward()
    (y * dy.float()).sum().backward(retain_graph=True)
    expected = [True, False, False] if layer.use_gate else [False, False]      # [z], a, b
    assert seen[:len(expected)] == expected, seen
    ref_params = dict(ref.named_parameters())
    first = {name: p.grad.clone() for name, p in layer.named_parameters()}
    assert rel_rmse(x.grad, xr.grad) < 1e-5
    for name, p in layer.named_parameters():
        assert rel_rmse(p.grad, ref_params[name].grad) < 1e-5, name
    dx_first = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    (y * dy.float()).sum().backward()                       # the same graph again: a new buffer, same result
    assert torch.equal(x.grad, dx_first)
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, first[name]), name


def test_conv_and_norm_bf16_close_to_float64_reference():
    """bf16 storage through the conv (aligned splits, several tiles) and the gated norm
    (in-place dgate) against float64: loose (the interpreter's float32 -> bf16 cast truncates)."""
    B, T, D, W = 1, 140, 384, 4
    x64, w64, b64, dy = _f64(B, T, D, seed=51), _f64(D, W, seed=52, scale=0.5), _f64(D, seed=53), _f64(B, T, D, seed=54)
    refs = [_leaf(t, torch.float64) for t in (x64, w64, b64)]
    y_ref, _ = short_conv_reference(*refs)
    g_ref = torch.autograd.grad((y_ref * dy).sum(), refs)
    leaves = [_leaf(t, torch.bfloat16) for t in (x64, w64, b64)]
    y, _ = short_conv(*leaves, splits=(128, 128, 128))
    grads = torch.autograd.grad((torch.cat(y, -1) * dy.bfloat16()).sum(), leaves)
    assert rel_rmse(torch.cat(y, -1), y_ref) < 1e-2
    for got, want in zip(grads, g_ref):
        assert rel_rmse(got, want) < 1e-2

    G, V = 4, 32
    n64, z64, nw64, ndy = (_f64(B, T, G, V, seed=55), _f64(B, T, G, V, seed=56), _f64(V, seed=57) * 0.2 + 1,
                           _f64(B, T, G, V, seed=58))
    refs = [_leaf(t, torch.float64) for t in (n64, z64, nw64)]
    g_ref = torch.autograd.grad((gated_rms_norm_reference(*refs, 1e-5) * ndy).sum(), refs)
    zbuf = torch.empty(B, T, 2 * G * V, dtype=torch.bfloat16)
    leaves = [_leaf(t, torch.bfloat16) for t in (n64, z64, nw64)]
    out = gated_rms_norm(*leaves, 1e-5, dgate_into=lambda: zbuf[..., G * V:].view(B, T, G, V))
    grads = torch.autograd.grad((out * ndy.bfloat16()).sum(), leaves)
    assert grads[1].data_ptr() == zbuf[..., G * V:].data_ptr()
    for got, want in zip(grads, g_ref):
        assert rel_rmse(got, want) < 1e-2


def test_prefill_then_decode_equals_full_forward():
    """Chunk prefill, then token-by-token decode through the recurrence, equals one full forward."""
    layer, _ = _pair(recurrent_threshold=8, chunk_size=16)
    x = _f64(2, 22, 32, seed=13).float()
    with torch.no_grad():
        full = layer(x)
        cache = GatedDeltaNetCache()
        pieces = [layer(x[:, :19], cache=cache)]
        for t in range(19, 22):
            pieces.append(layer(x[:, t:t + 1], cache=cache))
    state = cache.get(0)
    assert state.conv_state.shape == (2, layer.conv_dim, 4) and state.recurrent_state.dtype == torch.float32
    assert rel_rmse(torch.cat(pieces, 1), full) < 1e-5
    assert layer._use_recurrence(x[:, :1]) is False     # outside no_grad the layer needs the chunk op


def test_left_padded_prefill_then_decode_equals_packed_forward():
    """A left-padded prompt batch through the cache, then two decode steps, equals each sequence run whole."""
    layer, _ = _pair(recurrent_threshold=4)
    T = 6
    prompt = _f64(2, T, 32, seed=15).float()
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :T - 3] = 0
    steps = _f64(2, 2, 32, seed=16).float()
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        out = [layer(prompt, attention_mask=mask, cache=cache)[:, -1:]]
        for t in range(2):
            out.append(layer(steps[:, t:t + 1], attention_mask=torch.ones(2, T + t + 1), cache=cache))
        whole = [torch.cat([prompt[0], steps[0]]), torch.cat([prompt[1, T - 3:], steps[1]])]
        cu = torch.tensor([0, 8, 13], dtype=torch.int32)
        packed = layer(torch.cat(whole)[None], cu_seqlens=cu)[0]
    got = torch.cat(out, 1)                                     # [2, 3, hidden]: last prompt token + 2 steps
    want = torch.stack([packed[5:8], packed[10:13]])
    assert rel_rmse(got, want) < 1e-5


def test_auto_mode_picks_recurrence_only_without_grad_and_for_short_inputs(monkeypatch):
    import generated.gated_delta_rule as gdn
    picked = []
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        original = getattr(gdn, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            picked.append(_name.split("_")[0])
            return _original(*args, **kwargs)
        monkeypatch.setattr(gdn, name, spy)
    layer = GatedDeltaNet(**LAYER, recurrent_threshold=4)
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        layer(x)                       # short, no grad: recurrence
        layer(torch.randn(1, 6, 32))   # longer than the threshold: chunk
    layer(x)                           # parameters need grad: chunk
    assert picked == ["fused", "chunk", "chunk"]


def test_padded_batch_equals_packed():
    """A padded batch with an attention mask (left and right padding) equals the packed sequences."""
    layer, _ = _pair()
    lengths = [9, 14, 5]
    T = 14
    x64 = _f64(1, sum(lengths), 32, seed=14)
    cu = torch.tensor([0, 9, 23, 28], dtype=torch.int32)
    packed_x = _leaf(x64)
    packed = layer(packed_x, cu_seqlens=cu)
    (packed.square().sum()).backward()
    packed_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    padded_x = torch.zeros(3, T, 32)
    mask = torch.zeros(3, T, dtype=torch.long)
    rows = [(0, 0, 9), (1, 0, 14), (2, T - 5, T)]              # row 2 is left-padded
    for (row, start, end), bos, eos in zip(rows, cu[:-1].tolist(), cu[1:].tolist()):
        padded_x[row, start:end] = x64[0, bos:eos].float()
        mask[row, start:end] = 1
    padded_x.requires_grad_()
    out = layer(padded_x, attention_mask=mask)
    out.square().sum().backward()
    for (row, start, end), bos, eos in zip(rows, cu[:-1].tolist(), cu[1:].tolist()):
        assert rel_rmse(out[row, start:end], packed[0, bos:eos]) < 1e-6
        assert rel_rmse(padded_x.grad[row, start:end], packed_x.grad[0, bos:eos]) < 1e-5
    assert torch.all(out[mask == 0] == 0) and torch.all(padded_x.grad[mask == 0] == 0)
    for name, p in layer.named_parameters():
        assert rel_rmse(p.grad, packed_grads[name]) < 1e-5, name


# ---- transformers' Qwen3-Next on gdngen kernels -------------------------------------------------

def _qwen3_next_pair(seed=0):
    """A tiny random Qwen3NextForCausalLM (a linear-attention and a full-attention layer) and a patched copy.

    The gates are set to a moderate decay (g around -0.1 .. -1 per token).  At transformers' init
    (A ~ 10, g ~ -13 per token) the A_log / dt_bias gradients are ~1e-6 and transformers' own path,
    which runs the chunk recurrence in float32 whatever the model dtype, is only good to ~1% there.
    """
    transformers = pytest.importorskip("transformers")
    from gdngen.layers import patch_qwen3_next
    config = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    block = model.model.layers[0].linear_attn
    with torch.no_grad():
        block.A_log.copy_(torch.linspace(0.1, 1.0, 4).log())
        block.dt_bias.copy_(torch.linspace(-2.0, 0.5, 4))
        block.norm.weight.uniform_(0.5, 1.5)
    patched = copy.deepcopy(model)
    assert patch_qwen3_next(patched) == 1
    return model, patched


def _forbid_transformers_kernels(monkeypatch):
    """Make every kernel function transformers' block would call raise: the patched model must not use them."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def forbidden(*args, **kwargs):
        raise AssertionError("the patched block called transformers' own kernel path")
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        monkeypatch.setattr(hf, name, forbidden)
    monkeypatch.setattr(hf.Qwen3NextRMSNormGated, "forward", forbidden)


def test_qwen3_next_logits_loss_grads_match_transformers(monkeypatch):
    model, patched = _qwen3_next_pair()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = model(ids, labels=ids)
    ref.loss.backward()
    _forbid_transformers_kernels(monkeypatch)
    out = patched(ids, labels=ids)
    out.loss.backward()
    assert rel_rmse(out.logits, ref.logits) < 1e-5
    assert abs(out.loss.item() - ref.loss.item()) < 1e-5 * abs(ref.loss.item())
    ref_params = dict(model.named_parameters())
    checked = 0
    for name, p in patched.named_parameters():
        want = ref_params[name].grad
        if want is None or not want.abs().sum() > 0:        # e.g. experts no token was routed to
            assert p.grad is None or not p.grad.abs().sum() > 0, name
            continue
        assert rel_rmse(p.grad, want) < 1e-4, name
        checked += "linear_attn" in name
    assert checked == 7            # in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, norm, out_proj


@pytest.mark.parametrize("cache_api", ["installed", "without_readers"])
def test_qwen3_next_generate_gives_identical_tokens(monkeypatch, cache_api):
    """Greedy generation (prefill through the chunk op, decode through the recurrence, transformers'
    cache), a left-padded batch of two.  "without_readers": the cache as older transformers (5.17) has
    it, with no get_conv_state / get_recurrent_state / is_recording_past, only the layers' attributes."""
    model, patched = _qwen3_next_pair(seed=1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **options)
    if cache_api == "without_readers":
        from transformers import cache_utils
        for name in ("get_conv_state", "get_recurrent_state", "is_recording_past"):
            monkeypatch.delattr(cache_utils.Cache, name, raising=False)
    _forbid_transformers_kernels(monkeypatch)
    got = patched.generate(ids, **options)
    assert got.shape == (2, 12) and torch.equal(got, want)


def test_qwen3_next_packed_sequences_and_unpatch():
    """cu_seq_lens_q (padding-free packing) restarts conv and recurrence per sequence; unpatch restores."""
    from gdngen.layers import patch_qwen3_next, unpatch_qwen3_next
    model, patched = _qwen3_next_pair(seed=2)
    block = patched.model.layers[0].linear_attn
    x = torch.randn(1, 13, 32)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    with torch.no_grad():
        packed = block(x, cu_seq_lens_q=cu)
        apart = torch.cat([block(x[:, :6]), block(x[:, 6:])], dim=1)
    assert rel_rmse(packed, apart) < 1e-6
    assert unpatch_qwen3_next(patched) == 1
    assert type(block) is type(model.model.layers[0].linear_attn)
    assert patch_qwen3_next(patched) == 1 and patch_qwen3_next(patched) == 0     # idempotent
    with pytest.raises(ValueError, match="model"):
        patch_qwen3_next(torch.nn.Linear(2, 2))
