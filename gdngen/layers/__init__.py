"""Layers on the generated kernels: the GatedDeltaNet token mixer, its kernels and cache, and the
transformers Qwen3-Next adapter.

    from gdngen.layers import GatedDeltaNet, GatedDeltaNetCache
    layer = GatedDeltaNet(hidden_size=2048, num_heads=16, num_v_heads=32, head_dim=128, layer_idx=0)

``patch_qwen3_next(model)`` runs a transformers ``Qwen3NextForCausalLM`` on these kernels
(transformers is an optional dependency: ``pip install 'gdngen[layers]'``).
"""
from gdngen.layers.cache import GatedDeltaNetCache, LayerState
from gdngen.layers.gated_deltanet import GatedDeltaNet, gated_delta_rule_reference
from gdngen.layers.gated_norm import gated_rms_norm, gated_rms_norm_reference
from gdngen.layers.qwen3_next import patch_qwen3_next, unpatch_qwen3_next
from gdngen.layers.short_conv import short_conv, short_conv_reference

__all__ = ["GatedDeltaNet", "GatedDeltaNetCache", "LayerState", "gated_delta_rule_reference", "gated_rms_norm",
           "gated_rms_norm_reference", "patch_qwen3_next", "unpatch_qwen3_next", "short_conv", "short_conv_reference"]
