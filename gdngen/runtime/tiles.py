"""Tile and launch choices per stage.

Defaults live here; ``override`` lets a tuner or a benchmark try another choice for one stage of
one spec without touching generated code. (The per-device autotune cache plugs in here.)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from gdngen.runtime.launch import next_pow2

_OVERRIDES: dict[tuple[str, str], dict] = {}


SM_COUNT_H200 = 132


def default_tiles(stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype) -> dict:
    """Launch parameters that compile for every head dim up to 256 (tl.dot needs tiles >= 16).

    The numbers come from the stage sweep on the H200 (benchmarks/NOTES.md): the WY stage is
    latency-bound and prefers two warps; the state pass wants wide V tiles only while that still
    leaves a program per SM; the output stage prefers one V tile per chunk (QK^T computed once).
    """
    pk, pv = max(16, next_pow2(K)), max(16, next_pow2(V))
    if stage == "wy":
        return {"BK": min(64, pk), "BV": min(64, pv), "num_warps": 2, "num_stages": 2}
    if stage == "state":
        # the whole K extent of the state stays in registers: narrow V tiles for large K
        bv = min(pv, 64 if pk <= 128 else 16)
        while bv > 16 and N * HV * -(-V // bv) < SM_COUNT_H200 // 2:
            bv //= 2
        return {"BK": pk, "BV": bv, "num_warps": 4, "num_stages": 3}
    if stage == "output":
        # BV >= 64: BK=64 with BV=32 gave wrong outputs (K=64, V=32, bf16) under Triton 3.6 on Hopper
        return {"BK": min(64, pk), "BV": max(64, min(128, pv)), "num_warps": 4, "num_stages": 3}
    raise ValueError(f"stage: unknown stage {stage!r}")


def tiles(spec_name: str, stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype) -> dict:
    config = default_tiles(stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype)
    config.update(_OVERRIDES.get((spec_name, stage), {}))
    return config


@contextmanager
def override(spec_name: str, stage: str, **config):
    """Temporarily replace some launch parameters of one stage of one spec."""
    key = (spec_name, stage)
    previous = _OVERRIDES.get(key)
    _OVERRIDES[key] = dict(config)
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = previous
