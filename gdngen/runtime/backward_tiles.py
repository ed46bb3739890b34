"""Launch parameters of the generated backward stages (safe defaults; not yet in the autotuner)."""
from __future__ import annotations

import torch

from gdngen.runtime.launch import next_pow2
from gdngen.runtime.tiles import SM_COUNT_H200


def backward_tiles(stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype) -> dict:
    """BK / BV / warps for one backward launch; every head dim up to 256 (tl.dot needs tiles >= 16).

    The reverse state pass keeps the whole K extent of its [K, BV] gradient slice in registers,
    like the forward state pass, and narrows BV only while that leaves too few programs.
    """
    pk, pv = max(16, next_pow2(K)), max(16, next_pow2(V))
    if stage == "state":
        bv = min(pv, 64 if pk <= 128 else 16)
        while bv > 16 and N * HV * -(-V // bv) < SM_COUNT_H200 // 2:
            bv //= 2
        return {"BK": pk, "BV": bv, "num_warps": 4, "num_stages": 2}
    if stage in ("chunk", "wy"):
        return {"BK": min(64, pk), "BV": min(64, pv), "num_warps": 4, "num_stages": 2}
    if stage == "wy_prep":
        return {"BK": min(64, pk), "num_warps": 4, "num_stages": 2}
    raise ValueError(f"stage: unknown backward stage {stage!r}")
