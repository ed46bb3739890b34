"""Run transformers' Qwen3-Next on gdngen kernels.

transformers' ``Qwen3NextGatedDeltaNet.forward`` calls four module-level functions --
``causal_conv1d_fn`` / ``causal_conv1d_update`` (the short convolution, prefill / decode),
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (the GDN op) -- each FLA's or
causal-conv1d's kernel when installed, else a PyTorch fallback, plus ``self.norm``
(``Qwen3NextRMSNormGated``, unfused torch). :func:`patch_qwen3_next` swaps the class of every such
block in one model for a subclass whose forward keeps the block's parameters, its projection
layout and transformers' cache protocol, and replaces all five with gdngen:

* the short convolution + SiLU: :func:`gdngen.layers.short_conv`, with the cache's conv state
  as initial state, writing q, k, v as separate contiguous tensors;
* the gate ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` and the q/k L2 norm:
  fused into ``chunk_gated_delta_rule`` (training, prefill) or ``fused_recurrent_gated_delta_rule``
  (one-token decode without gradients);
* the gated RMSNorm: :func:`gdngen.layers.gated_rms_norm`, one kernel.

Packed sequences (``cu_seq_lens_q`` in the forward kwargs, as transformers passes them when
padding-free training) restart both the convolution and the recurrence at every sequence start.
The swap touches nothing else (module names, ``state_dict``, other layers are unchanged), applies
to this model only, and :func:`unpatch_qwen3_next` undoes it::

    from transformers import Qwen3NextForCausalLM
    from gdngen.layers import patch_qwen3_next
    model = Qwen3NextForCausalLM.from_pretrained(...)
    patch_qwen3_next(model)          # returns the number of blocks swapped
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from gdngen.layers.gated_norm import gated_rms_norm
from gdngen.layers.short_conv import short_conv

_PATCHED: dict[type, type] = {}          # original block class -> its gdngen subclass


def _hf():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next
    except ImportError as error:        # pragma: no cover - depends on the environment
        raise ImportError("patch_qwen3_next needs transformers with Qwen3-Next (>= 5.17): "
                          "pip install 'gdngen[layers]'") from error
    return modeling_qwen3_next


def _gdn():
    from generated import gated_delta_rule
    return gated_delta_rule


def _needs_grad(module: nn.Module, x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


# transformers' linear-attention cache (``LinearAttentionLayer`` in ``cache_utils``, since 5.x) keeps, per layer,
# ``conv_states`` / ``recurrent_states`` / ``has_previous_state`` dicts keyed by state index and a
# ``record_past`` flag, and ``Cache.update_conv_state`` / ``update_recurrent_state``.  Newer releases
# (5.24 here) add the readers ``Cache.get_conv_state`` / ``get_recurrent_state`` / ``is_recording_past``;
# older ones (5.17, the GPU machine's) read the layer's attributes directly, as their Qwen3-Next forward
# does.  Use the readers where the cache has them, else the same attributes they read.

def _cached_state(cache, layer_idx: int, kind: str) -> Optional[torch.Tensor]:
    """The cache's ``kind`` ("conv" / "recurrent") state of layer ``layer_idx``, None before its first update."""
    getter = getattr(cache, f"get_{kind}_state", None)
    if getter is not None:
        return getter(layer_idx)
    layer = cache.layers[layer_idx]
    # None until the first update_conv_state, and after a reset (which zeroes the tensors but keeps them)
    return getattr(layer, f"{kind}_states")[0] if layer.has_previous_state[0] else None


def _is_recording_past(cache, layer_idx: int) -> bool:
    """Whether the cache keeps every past conv input of the layer (for a later crop), as transformers asks."""
    reader = getattr(cache, "is_recording_past", None)
    if reader is not None:
        return reader(layer_idx)
    return getattr(cache.layers[layer_idx], "record_past", False)


def _gdngen_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: Optional[torch.Tensor] = None,
                    **kwargs):
    """``Qwen3NextGatedDeltaNet.forward`` on gdngen kernels (same arguments, same cache protocol)."""
    hf = _hf()
    if cache is None:
        cache = kwargs.pop("cache_params", None)      # its name in older releases (5.17)
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    B, T, _ = hidden_states.shape
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    W = self.conv_kernel_size

    conv_state = recurrent_state = None
    if cache is not None:
        conv_state = _cached_state(cache, self.layer_idx, "conv")
        recurrent_state = _cached_state(cache, self.layer_idx, "recurrent")

    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
    mixed_qkv = torch.cat([x.reshape(B, T, -1) for x in (query, key, value)], dim=-1)
    weight = self.conv1d.weight.squeeze(1)
    splits = (self.key_dim, self.key_dim, self.value_dim)
    if cache is not None and _is_recording_past(cache, self.layer_idx):
        # transformers keeps every past input for a later crop: let it assemble the window, convolve it all
        full = cache.update_conv_state(mixed_qkv.transpose(1, 2), self.layer_idx, conv_kernel_size=W)
        (q, k, v), _ = short_conv(full.transpose(1, 2), weight, self.conv1d.bias, activation=self.activation,
                                  splits=splits)
        q, k, v = q[:, -T:], k[:, -T:], v[:, -T:]
    else:
        (q, k, v), final_conv = short_conv(
            mixed_qkv, weight, self.conv1d.bias, activation=self.activation, cu_seqlens=cu_seqlens,
            initial_state=conv_state, output_final_state=cache is not None, splits=splits)
        if cache is not None:
            if conv_state is None:
                cache.update_conv_state(final_conv, self.layer_idx, conv_kernel_size=W)   # allocates it
            else:
                conv_state.copy_(final_conv)      # in place: the cache keeps its static address
    q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
    k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
    v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

    gdn = _gdn()
    options = dict(initial_state=recurrent_state, output_final_state=cache is not None, cu_seqlens=cu_seqlens,
                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                   use_beta_sigmoid_in_kernel=True)
    if recurrent_state is not None and T == 1 and not _needs_grad(self, hidden_states):
        o, last_state = gdn.fused_recurrent_gated_delta_rule(q, k, v, a, b, **options)
    else:
        o, last_state = gdn.chunk_gated_delta_rule(q, k, v, a, b, **options)
    if cache is not None:
        cache.update_recurrent_state(last_state, self.layer_idx)

    o = gated_rms_norm(o, z.reshape(B, T, self.num_v_heads, self.head_v_dim), self.norm.weight,
                       self.norm.variance_epsilon, activation=self.norm.activation)
    return self.out_proj(o.reshape(B, T, -1))


def _patched_class(cls: type) -> type:
    if cls not in _PATCHED:
        forward = _gdngen_forward
        try:       # fire accelerate's offload hooks of conv1d, whose weight is read directly (as upstream does)
            from transformers.integrations.accelerate import force_accelerate_hooks
            forward = force_accelerate_hooks("conv1d")(forward)
        except ImportError:      # pragma: no cover - older transformers
            pass
        _PATCHED[cls] = type(f"Gdngen{cls.__name__}", (cls,), {
            "forward": functools.wraps(_gdngen_forward)(forward), "_gdngen_original_class": cls,
            "__doc__": f"{cls.__name__} running on gdngen kernels (see gdngen.layers.qwen3_next)."})
    return _PATCHED[cls]


def patch_qwen3_next(model: nn.Module) -> int:
    """Run every ``Qwen3NextGatedDeltaNet`` block of ``model`` on gdngen kernels, in place.

    Returns the number of blocks swapped (already patched blocks are left as they are).  Raises
    ``ValueError`` when ``model`` has no such block or a block uses an activation other than SiLU.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    block_class = _hf().Qwen3NextGatedDeltaNet
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    if not blocks:
        raise ValueError(f"model: no Qwen3NextGatedDeltaNet block in {type(model).__name__}")
    swapped = 0
    for block in blocks:
        if getattr(type(block), "_gdngen_original_class", None) is not None:
            continue
        if block.activation not in ("silu", "swish"):
            raise ValueError(f"model: block {block.layer_idx} uses activation {block.activation!r}; "
                             "gdngen's short convolution implements silu")
        block.__class__ = _patched_class(type(block))
        swapped += 1
    return swapped


def unpatch_qwen3_next(model: nn.Module) -> int:
    """Give every patched block of ``model`` its original class back; returns how many."""
    restored = 0
    for block in model.modules():
        original = getattr(type(block), "_gdngen_original_class", None)
        if original is not None:
            block.__class__ = original
            restored += 1
    return restored
