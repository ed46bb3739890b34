"""The search space per stage, pruned by resource estimates before anything compiles.

A candidate is a launch config for one stage: tile sizes ``BK``/``BV`` (powers of two >= 16, the
minimum ``tl.dot`` tile, up to the padded head dim), ``num_warps`` and ``num_stages``. The chunk
size ``BT`` is a separate axis (one of ``spec.chunk.sizes``): it changes every stage's kernel and
the number of chunks, so the tuner tunes each chunk size on its own and compares totals.

The estimates below are deliberately simple upper bounds, written per stage from what the
generated kernels keep live (see the stage kernels in generated/<spec>.py). They only remove
configs that cannot be fast (register spills) or cannot launch (shared memory). The default
config of a shape is never pruned: it is the baseline every candidate is checked against.

Registers per thread  = ceil(live fp32 elements per program / (32 * num_warps)) + REG_OVERHEAD
  wy      A and T = (I + A)^-1 as NB(NB+1) 16x16 fp32 blocks (NB = BT/16, lower triangles incl.
          the diagonal of both), plus the [BT, BK] key tile (the stage has no V tile: no BV)
  state   the [BK, BV] fp32 state (the whole K extent: BK covers K), plus the [BT, BV] V_new tile
  output  the [BT, BV] output accumulator plus the [BT, BT] fp32 score block
must stay <= 255 (the per-thread hardware limit; past it the kernel spills to local memory).

Shared memory per program = num_stages * (operand bytes streamed per loop step) + resident bytes
  wy      streamed [BT, BK] keys; resident T (BT x BT) on its way out
  state   streamed k [BT, BK], v [BT, BV] and T [BT, BT]; resident the state as a [BK, BV] dot operand
  output  streamed q, k [BT, BK] and h [BK, BV]; resident A [BT, BT] and V_new [BT, BV]
(element size of the input dtype) must fit the device's shared memory per block
(:data:`gdngen.autotune.device.SMEM_PER_BLOCK`, 227 KiB on H100/H200, 48 KiB when unknown).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from gdngen.autotune.device import DeviceInfo, SMEM_FALLBACK

STAGES = ("wy", "state", "output")
WARPS = (2, 4, 8)
PIPELINE_STAGES = (1, 2, 3, 4)
MIN_TILE = 16
REG_LIMIT = 255
REG_OVERHEAD = 32          # addresses, masks, loop counters, gate vectors


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tiles_up_to(n: int) -> list[int]:
    top = max(MIN_TILE, _pow2(n))
    return [1 << i for i in range(4, top.bit_length()) if (1 << i) <= top]


@dataclass(frozen=True)
class Exclusion:
    """A config known to give wrong results or to crash: never a candidate, never read from a cache.

    ``config`` entries must all match; ``when`` restricts it to shapes (keys K, V, BT, dtype);
    an empty ``when`` excludes it for every shape (the failure was seen on one shape, and a
    miscompile there is reason enough to distrust the config elsewhere).
    """
    stage: str
    config: dict
    when: dict = field(default_factory=dict)
    reason: str = ""

    def matches(self, stage: str, config: dict, shape: dict) -> bool:
        if stage != self.stage:
            return False
        if any(config.get(k) != v for k, v in self.config.items()):
            return False
        return all(shape.get(k) == v for k, v in self.when.items())


KNOWN_BAD: tuple[Exclusion, ...] = (
    Exclusion("output", {"BK": 64, "BV": 32}, {},
              "Triton 3.6 on Hopper miscompiled it: wrong output rows from row 16 on "
              "(K=64, V=32, bf16; state and final state right) - benchmarks/NOTES.md, run 3"),
    Exclusion("state", {"num_warps": 8}, {"K": 64},
              "illegal address with 8 warps (K=64, V=32, bf16, Triton 3.6, H200) - "
              "benchmarks/NOTES.md, run 3; an illegal address kills the CUDA context, so the tuner "
              "cannot survive trying it"),
)


def excluded(stage: str, config: dict, shape: dict) -> Optional[Exclusion]:
    for rule in KNOWN_BAD:
        if rule.matches(stage, config, shape):
            return rule
    return None


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def regs_per_thread(stage: str, config: dict, *, BT: int) -> int:
    BK, BV = config["BK"], config.get("BV", 0)
    if stage == "wy":
        nb = BT // 16
        live = nb * (nb + 1) * 256 + BT * BK
    elif stage == "state":
        live = BK * BV + BT * BV
    elif stage == "output":
        live = BT * BV + BT * BT
    else:
        raise ValueError(f"stage: unknown stage {stage!r}")
    return math.ceil(live / (32 * config["num_warps"])) + REG_OVERHEAD


def smem_bytes(stage: str, config: dict, *, BT: int, dtype: torch.dtype) -> int:
    BK, BV, e = config["BK"], config.get("BV", 0), _esize(dtype)
    if stage == "wy":
        streamed, resident = BT * BK, BT * BT
    elif stage == "state":
        streamed, resident = BT * (BK + BV + BT), BK * BV
    elif stage == "output":
        streamed, resident = 2 * BT * BK + BK * BV, BT * BT + BT * BV
    else:
        raise ValueError(f"stage: unknown stage {stage!r}")
    return (config["num_stages"] * streamed + resident) * e


def fits(stage: str, config: dict, *, BT: int, dtype: torch.dtype, device: Optional[DeviceInfo]) -> Optional[str]:
    """None when the config passes the estimates, else why it does not."""
    regs = regs_per_thread(stage, config, BT=BT)
    if regs > REG_LIMIT:
        return f"~{regs} registers/thread > {REG_LIMIT}"
    smem, limit = smem_bytes(stage, config, BT=BT, dtype=dtype), (device.smem if device else SMEM_FALLBACK)
    if smem > limit:
        return f"~{smem // 1024} KiB shared memory > {limit // 1024} KiB"
    return None


def is_valid(stage: str, config: dict, *, K: int, V: int) -> bool:
    """Structurally launchable for this head-dim pair (used on configs read from a cache too)."""
    try:
        BK, w, s = config["BK"], config["num_warps"], config["num_stages"]
        BV = None if stage == "wy" else config["BV"]       # the wy stage has no V tile
    except (KeyError, TypeError):
        return False
    if stage == "wy" and "BV" in config:
        return False
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (BK, w, s) + (() if BV is None else (BV,))):
        return False
    # tiles past the head dim are masked, only wasteful (the output default keeps BV >= 64)
    for tile, dim in ((BK, K),) + (() if BV is None else ((BV, V),)):
        if tile < MIN_TILE or tile & (tile - 1) or tile > max(128, _pow2(dim)):
            return False
    if stage == "state" and BK != max(MIN_TILE, _pow2(K)):   # the state keeps the whole K extent
        return False
    return w in (1, 2, 4, 8, 16) and 1 <= s <= 8


def stages_for(spec) -> list[str]:
    """Stages a spec's chunk forward launches with tiles(): the WY stage only for the delta family."""
    return [s for s in STAGES if s != "wy" or spec.transition.delta]


def chunk_sizes(spec) -> list[int]:
    return list(spec.chunk.sizes)


def _distance(config: dict, default: dict) -> tuple:
    changed = sum(config[k] != default[k] for k in default)
    spread = sum(abs(math.log2(config[k] / default[k])) for k in default)
    return changed, spread, tuple(config[k] for k in sorted(default))


def candidates(stage: str, *, K: int, V: int, BT: int, dtype: torch.dtype, default: dict,
               device: Optional[DeviceInfo] = None, limit: Optional[int] = None,
               pruned: Optional[list] = None) -> list[dict]:
    """Configs to try for one stage and shape: the default first, then the pruned space nearest it.

    ``limit`` caps the list (default included), keeping the configs closest to the default;
    ``pruned`` (a list) collects ``(config, reason)`` for everything left out.
    """
    shape = {"K": K, "V": V, "BT": BT, "dtype": dtype}
    bks = [max(MIN_TILE, _pow2(K))] if stage == "state" else _tiles_up_to(K)
    out = []
    bvs = [None] if stage == "wy" else _tiles_up_to(V)
    for bk, bv, w, s in itertools.product(bks, bvs, WARPS, PIPELINE_STAGES):
        config = {"BK": bk, "num_warps": w, "num_stages": s} if bv is None else \
            {"BK": bk, "BV": bv, "num_warps": w, "num_stages": s}
        if config == default:
            continue
        rule = excluded(stage, config, shape)
        why = f"known bad: {rule.reason}" if rule else fits(stage, config, BT=BT, dtype=dtype, device=device)
        if why:
            if pruned is not None:
                pruned.append((config, why))
            continue
        out.append(config)
    out.sort(key=lambda c: _distance(c, default))
    out.insert(0, dict(default))
    return out[:limit] if limit else out
