"""Generation cache for GatedDeltaNet layers: one conv state and one recurrent state per layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass
class LayerState:
    """What one layer carries from a call to the next, for ``N`` sequences.

    ``conv_state``: ``[N, D_conv, W]`` the last ``W`` inputs of the short convolution (the
    activation dtype); ``recurrent_state``: ``[N, HV, K, V]`` float32 delta-rule state.
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor


class GatedDeltaNetCache:
    """Per-layer states of a stack of :class:`~gdngen.layers.GatedDeltaNet` layers, keyed by ``layer_idx``.

    Pass the same cache to every call of a generation: a layer reads its states (if any), runs
    from them, and stores the new ones. A prefill followed by token-by-token decode calls then gives
    the same outputs as one call over the whole sequence.
    """

    def __init__(self) -> None:
        self._layers: dict[int, LayerState] = {}

    def get(self, layer_idx: int) -> Optional[LayerState]:
        """The states of layer ``layer_idx``, or None before its first call."""
        return self._layers.get(layer_idx)

    def update(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """Store the states a layer produced (replacing the previous ones)."""
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
            raise TypeError(f"layer_idx: expected an int, got {layer_idx!r}")
        if conv_state.shape[0] != recurrent_state.shape[0]:
            raise ValueError(f"conv_state, recurrent_state: expected one batch of sequences, got "
                             f"{tuple(conv_state.shape)} and {tuple(recurrent_state.shape)}")
        self._layers[layer_idx] = LayerState(conv_state, recurrent_state)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Keep / repeat sequences by index along the batch axis (beam search)."""
        for state in self._layers.values():
            idx = beam_idx.to(state.conv_state.device)
            state.conv_state = state.conv_state.index_select(0, idx)
            state.recurrent_state = state.recurrent_state.index_select(0, idx)

    def reset(self) -> None:
        """Forget every layer's states (the next call starts a new generation)."""
        self._layers.clear()

    @property
    def num_sequences(self) -> Optional[int]:
        """The number of sequences held, or None while empty."""
        for state in self._layers.values():
            return state.conv_state.shape[0]
        return None

    def __contains__(self, layer_idx: int) -> bool:
        return layer_idx in self._layers

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._layers))

    def __repr__(self) -> str:
        return f"GatedDeltaNetCache(layers={sorted(self._layers)}, sequences={self.num_sequences})"
