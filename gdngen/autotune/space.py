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
  state_output  the state's, plus the [BT, BV] output and the [BT, BT] score block
must stay <= 255 (the per-thread hardware limit; past it the kernel spills to local memory).

Shared memory per program = num_stages * (operand bytes streamed per loop step) + resident bytes
  wy      streamed [BT, BK] keys; resident T (BT x BT) on its way out
  state   streamed k [BT, BK], v [BT, BV] and T [BT, BT]; resident the state as a [BK, BV] dot operand
  output  streamed q, k [BT, BK] and h [BK, BV]; resident A [BT, BT] and V_new [BT, BV]
  state_output  the state's, plus streamed q [BT, BK] and the scores [BT, BT]
(element size of the input dtype) must fit the device's shared memory per block
(:data:`gdngen.autotune.device.SMEM_PER_BLOCK`, 227 KiB on H100/H200, 48 KiB when unknown).

Backward stages (the generated chunk backward, ``gdngen.runtime.backward_tiles``) are named with a
``_bwd`` suffix here and in the cache (``state_bwd`` is the reverse state pass, ``state`` the
forward one): wy_prep_bwd, intra_bwd, state_bwd, chunk_bwd, wy_bwd, and wy_decay_bwd (vector
decay + delta rule only). Their hard rules (backward_tiles.py) shape the space, never pruned away
by a cache either: the state pass keeps the whole K extent (BK = pow2(K)) and never runs with one
pipeline stage (illegal accesses on the H200); the intra, chunk and wy stages never take a tile
below 64 (the Hopper miscompile: no [*, 32] product beside a 64-wide one). Only kernels with a
runtime loop (state_bwd over chunks, the scalar-decay intra_bwd over key tiles) get num_stages
variants: the others loop with tl.static_range (unrolled, nothing for the pipeliner), so their
num_stages stays the default's. Estimates, per program (``+ 256 BK`` with per-channel decay: the
[16, 16, BK] diagonal-block products of the 16-row sub-block kernels):
  registers                                       shared (streamed x num_stages + resident)
  wy_prep_bwd   T [BT, BT], W tile [BT, BK]         2 [BT, BK];             T
  intra_bwd     P [BT, BT], dv [BT, BV] (+256 BK)   q, k [BT, BK];          P, dO [BT, BV]
  state_bwd     dh [BK, BV], dv and dO [BT, BV]     [BT, BK] + [BT, BV];    dh, a [BT, BK] operand
  chunk_bwd     dq dk dw [BT, BK], dS, <h, dh>      h, dh [BK, BV], 3 [BT, BV]; dS, q, k
  wy_bwd        T, dRR, KK [BT, BT], dR [BT, BK]    2 [BT, BK] + 2 [BT, BV] (+ S [BK, BV]); T, dRR
                (+ K S, dR_v [BT, BV])
  wy_decay_bwd  dA (2) [BT, BT], 8 [BT, BK]          2 [BT, BK];             dA
Deliberately rough: the tuner checks and times what survives, and rejects what fails to compile.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from gdngen.autotune.device import DeviceInfo, SMEM_FALLBACK

# state_output: the state pass of a forward nothing differentiates, which writes the output itself
# (tiles.fused_output); it replaces state and output there and is tuned on such a forward
STAGES = ("wy", "state", "output", "state_output")
# backward stages in launch order; the runtime (backward_tiles) names them without the suffix
BACKWARD_SUFFIX = "_bwd"
BACKWARD_STAGES = ("wy_prep_bwd", "intra_bwd", "state_bwd", "chunk_bwd", "wy_bwd", "wy_decay_bwd")
ALL_STAGES = STAGES + BACKWARD_STAGES
# words `gdngen tune --stages` (and tune(stages=...)) accept for a whole phase
STAGE_GROUPS = {"fwd": STAGES, "forward": STAGES, "bwd": BACKWARD_STAGES, "backward": BACKWARD_STAGES,
                "all": ALL_STAGES}
WARPS = (2, 4, 8)
PIPELINE_STAGES = (1, 2, 3, 4)
MIN_TILE = 16
# the intra, chunk and wy backward stages never tile below 64 (backward_tiles.py: Triton 3.6 on
# Hopper gave wrong dk / dg with a 32-wide tile beside the 64-wide dS and dA products)
BACKWARD_WIDE_STAGES = ("intra_bwd", "chunk_bwd", "wy_bwd")
BACKWARD_MIN_WIDE_TILE = 64
# ... except intra's key tile, which is only ever a contraction width (its products are [BT, BT] and
# [BT, BV]): 32 there (the per-channel default, verified on the H200 at chunk 16/32/64, K=20..256)
INTRA_MIN_BK = 32
_NO_V_TILE = ("wy", "wy_prep_bwd", "wy_decay_bwd")
# backward kernels with a runtime loop (the others only use tl.static_range: num_stages is moot)
_BACKWARD_PIPELINED = ("state_bwd", "intra_bwd")
REG_LIMIT = 255
REG_OVERHEAD = 32          # addresses, masks, loop counters, gate vectors


def is_backward(stage: str) -> bool:
    return stage in BACKWARD_STAGES


def runtime_stage(stage: str) -> str:
    """The name the runtime gives a stage: ``state_bwd`` -> ``state`` (backward_tiles); forward as is."""
    return stage[:-len(BACKWARD_SUFFIX)] if is_backward(stage) else stage


def has_v_tile(stage: str) -> bool:
    return stage not in _NO_V_TILE


def config_keys(stage: str) -> tuple:
    """The launch parameters a stage's config holds (no BV for wy, wy_prep_bwd, wy_decay_bwd)."""
    return ("BK", "BV", "num_warps", "num_stages") if has_v_tile(stage) else ("BK", "num_warps", "num_stages")


# The persistent grid (stages/_persistent.j2, gdngen.runtime.launch.tile_grid): an optional key of the
# backward stages whose kernels take one - absent means one program per tile. Stage -> whether the
# per-channel decay's kernel takes it too (its chunk and wy kernels are separate ones, without it).
PERSISTENT_STAGES = {"wy_prep_bwd": True, "chunk_bwd": False, "wy_bwd": False}
# programs per SM the tuner tries beside one program per tile (offline sm_90: the chunk and wy kernels fit one
# per SM, wy_prep four). Ranked after every one-program-per-tile config: on the H200 it lost for chunk and wy
# (+2.5-8% fwd+bwd at the long shapes) and tied for wy_prep (stop 31, benchmarks/NOTES.md), so a capped search
# spends its slots on tiles first.
PERSISTENT_PER_SM = (1, 2)


def optional_keys(stage: str) -> tuple:
    """Launch options a stage's config may hold beside config_keys (absent: off)."""
    return ("PERSISTENT",) if stage in PERSISTENT_STAGES else ()


def has_config_keys(stage: str, config) -> bool:
    """Whether ``config`` holds every key of config_keys(stage) and nothing but its optional keys besides."""
    if not isinstance(config, dict):
        return False
    required = set(config_keys(stage))
    return required <= set(config) <= required | set(optional_keys(stage))


def expand_stages(names) -> list[str]:
    """Stage names and group words (fwd, bwd, all) -> stage names in launch order; ValueError on
    anything unknown."""
    wanted, unknown = set(), []
    for name in names:
        name = name.strip()
        if name in STAGE_GROUPS:
            wanted.update(STAGE_GROUPS[name])
        elif name in ALL_STAGES:
            wanted.add(name)
        elif name:
            unknown.append(name)
    if unknown:
        raise ValueError(f"stages: unknown {unknown}, expected some of {list(ALL_STAGES)} "
                         f"or {sorted(set(STAGE_GROUPS))}")
    return [s for s in ALL_STAGES if s in wanted]


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
    Exclusion("state", {"num_stages": 1}, {},
              "illegal memory access with one pipeline stage (GDN, K=V=128 bf16, BV=16, Triton 3.6, "
              "H200: the first config of a sweep, stop 19; the backward state pass the same since stop 15)"),
)


def excluded(stage: str, config: dict, shape: dict) -> Optional[Exclusion]:
    # state_output launches the state kernel: its known-bad configs are the state stage's
    kernel_stage = "state" if stage == "state_output" else stage
    for rule in KNOWN_BAD:
        if rule.matches(kernel_stage, config, shape):
            return rule
    return None


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def regs_per_thread(stage: str, config: dict, *, BT: int, per_channel: bool = False) -> int:
    BK, BV = config["BK"], config.get("BV", 0)
    blocks = 256 * BK if per_channel else 0        # a [16, 16, BK] diagonal-block product
    if stage == "wy":
        nb = BT // 16
        live = nb * (nb + 1) * 256 + BT * BK
        if per_channel:
            # level products (stages/_channel_chunk_scores.j2): [BT, BT] A and a level's dot, and
            # the k, g, g_r and decayed [BT, BK] tiles; ptxas at BT=64: 127 registers at BK=32 /
            # 8 warps, 216 at 4 warps, 248 at BK=64 / 4 warps, 223 at BK=128 / 8 warps (no
            # spill), BK=128 / 4 warps spills
            return math.ceil((2 * BT * BT + 4 * BT * BK) / (32 * config["num_warps"])) + REG_OVERHEAD
    elif stage == "state":
        live = BK * BV + BT * BV
    elif stage == "state_output":
        live = BK * BV + 2 * BT * BV + BT * BT
    elif stage == "output":
        # per channel: a second [BT, BT] (the level sums, then the diagonal) and the level's
        # q-or-k, g and g_r tiles (ptxas: 115 registers at BT=64, BK=32, BV=128, 8 warps, 2 stages)
        live = BT * BV + BT * BT + (BT * BT + 3 * BT * BK if per_channel else 0)
    elif stage == "wy_prep_bwd":
        live = BT * BT + BT * BK
    elif stage == "intra_bwd":
        # per channel: the scores level by level from q-or-k, g and g_r tiles plus a level sum
        # (ptxas: 102 registers at BT=64, BK=64, BV=128, 8 warps, 1 stage; 226 at 4 warps)
        live = BT * BT + BT * BV + (BT * BT + 3 * BT * BK if per_channel else 0)
    elif stage == "state_bwd":
        live = BK * BV + 2 * BT * BV
    elif stage == "chunk_bwd":
        # per channel: dq, dk, q, k, g and a level's exponent tile beside dP (levels since
        # 2026-11-30, no [16, 16, BK] block product)
        live = (6 if per_channel else 3) * BT * BK + BT * BT + BK * BV
    elif stage == "wy_bwd":
        # scalar / no decay (stop 38): K S and dR_v [BT, BV] per value tile beside T, dR R^T and K K^T
        live = 3 * BT * BT + BT * BK + (0 if per_channel else 2 * BT * BV)
    elif stage == "wy_decay_bwd":
        # levels since kda-wy-levels: dA + dA^T and its level-masked copy [BT, BT]; Y, X, k, g,
        # g_r, the exponent, the dot operand and result [BT, BK] (ptxas at BT=64: 250 registers at
        # BK=64 / 8 warps, 215 at BK=32 / 8 warps, no spill; BK=64 / 4 warps spills)
        live = 2 * BT * BT + 8 * BT * BK
    else:
        raise ValueError(f"stage: unknown stage {stage!r}")
    return math.ceil(live / (32 * config["num_warps"])) + REG_OVERHEAD


def smem_bytes(stage: str, config: dict, *, BT: int, dtype: torch.dtype, K: Optional[int] = None,
               V: Optional[int] = None) -> int:
    """Estimated shared bytes of one program. ``K`` and ``V`` (the head dims) let a persistent kernel whose
    tile loops are unrolled count every load site it buffers (scalar wy_bwd); without them, one site per tile."""
    BK, BV, e = config["BK"], config.get("BV", 0), _esize(dtype)
    if stage == "wy":
        streamed, resident = BT * BK, BT * BT
    elif stage == "state":
        streamed, resident = BT * (BK + BV + BT), BK * BV
    elif stage == "state_output":
        streamed, resident = BT * (2 * BK + BV + 2 * BT), BK * BV
    elif stage == "output":
        streamed, resident = 2 * BT * BK + BK * BV, BT * BT + BT * BV
    elif stage in ("wy_prep_bwd", "wy_decay_bwd"):
        streamed, resident = 2 * BT * BK, BT * BT
    elif stage == "intra_bwd":
        streamed, resident = 2 * BT * BK, BT * BT + BT * BV
    elif stage == "state_bwd":
        streamed, resident = BT * (BK + BV), BK * BV + BT * BK
    elif stage == "chunk_bwd":
        streamed, resident = 2 * BK * BV + 3 * BT * BV, BT * BT + 2 * BT * BK
    elif stage == "wy_bwd":
        # (scalar / no decay: k [BT, BK] with S [BK, BV], then v and dV_new [BT, BV])
        streamed, resident = 2 * BT * (BK + BV) + BK * BV, 2 * BT * BT
    else:
        raise ValueError(f"stage: unknown stage {stage!r}")
    if config.get("PERSISTENT"):
        # the pipeliner buffers every load of the tile loop, one copy per stage (offline sm_90: chunk_bwd
        # 156 KB at BK=64, BV=128, two stages; benchmarks/results/2026-12-01-offline-stop30-persistent-backward.md)
        if stage == "wy_bwd" and K is not None and V is not None:
            # the wy-first kernel (stop 38) unrolls its value and key tiles: k and S per (value, key) tile
            # pair, v and dV_new per value tile, k again per key tile for K K^T, and T, each its own buffer,
            # and nothing resident beside them. Offline sm_90 (Triton 3.9, bf16, BK=BV=64, two stages):
            # 232 KiB at K=V=128 (this: 240), 144 at K=128 / V=64 (144), 96 at K=V=64 (96)
            nk, nv = -(-K // BK), -(-V // BV)
            streamed, resident = nv * nk * (BT * BK + BK * BV) + nv * 2 * BT * BV + nk * BT * BK + BT * BT, 0
        return config["num_stages"] * (streamed + resident) * e
    return (config["num_stages"] * streamed + resident) * e


def fits(stage: str, config: dict, *, BT: int, dtype: torch.dtype, device: Optional[DeviceInfo],
         per_channel: bool = False, K: Optional[int] = None, V: Optional[int] = None) -> Optional[str]:
    """None when the config passes the estimates, else why it does not (``K``, ``V``: see smem_bytes)."""
    regs = regs_per_thread(stage, config, BT=BT, per_channel=per_channel)
    if regs > REG_LIMIT:
        return f"~{regs} registers/thread > {REG_LIMIT}"
    smem, limit = smem_bytes(stage, config, BT=BT, dtype=dtype, K=K, V=V), (device.smem if device else SMEM_FALLBACK)
    if smem > limit:
        return f"~{smem // 1024} KiB shared memory > {limit // 1024} KiB"
    return None


def backward_problem(stage: str, config, *, K: int, V: int) -> Optional[str]:
    """None when ``config`` is a launchable, safe config of backward ``stage`` (``state_bwd`` ...)
    for this head-dim pair, else what is wrong (the hard rules of backward_tiles.py)."""
    if not has_config_keys(stage, config):
        return (f"keys {sorted(config) if isinstance(config, dict) else config!r}, expected {list(config_keys(stage))}"
                + (f" (and optionally {list(optional_keys(stage))})" if optional_keys(stage) else ""))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in config.values()):
        return "every value must be an integer"
    if "PERSISTENT" in config and config["PERSISTENT"] < 1:
        return f"PERSISTENT={config['PERSISTENT']}: programs per SM >= 1 (absent: one program per tile)"
    for key, dim in (("BK", K), ("BV", V)):
        tile = config.get(key)
        if tile is None:
            continue
        floor = BACKWARD_MIN_WIDE_TILE if stage in BACKWARD_WIDE_STAGES else MIN_TILE
        if stage == "intra_bwd" and key == "BK":
            floor = INTRA_MIN_BK
        if tile < MIN_TILE or tile & (tile - 1):
            return f"{key}={tile}: a power of two >= {MIN_TILE} is needed"
        if tile < floor:
            return (f"{key}={tile}: the {stage} stage never tiles below {floor} (Hopper miscompile beside "
                    "the 64-wide products)")
        if tile > max(128, _pow2(dim)):
            return f"{key}={tile}: past the padded head dim {_pow2(dim)}"
    if stage == "state_bwd" and config["BK"] != max(MIN_TILE, _pow2(K)):
        return f"BK={config['BK']}: the state stage keeps the whole K extent ({max(MIN_TILE, _pow2(K))})"
    if stage == "state_bwd" and config["num_stages"] < 2:
        return "num_stages=1: the state stage needs >= 2 (illegal memory accesses on the H200)"
    if config["num_warps"] not in (1, 2, 4, 8, 16) or not 1 <= config["num_stages"] <= 8:
        return f"num_warps={config['num_warps']} / num_stages={config['num_stages']} out of range"
    return None


def is_valid(stage: str, config: dict, *, K: int, V: int) -> bool:
    """Structurally launchable for this head-dim pair (used on configs read from a cache too)."""
    if is_backward(stage):
        return backward_problem(stage, config, K=K, V=V) is None
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
    if stage in ("state", "state_output") and BK != max(MIN_TILE, _pow2(K)):   # the state keeps the whole K extent
        return False
    return w in (1, 2, 4, 8, 16) and 1 <= s <= 8


def stages_for(spec) -> list[str]:
    """Stages a spec's chunk forward launches with tiles(): the WY stage only for the delta family,
    state_output only where the state pass can write the output (scalar decay: plan's state_pieces)."""
    from gdngen.plan import build_plan          # sympy: only when a forward is tuned
    fused = build_plan(spec).exprs.get("state_pieces", False) if spec.has_decay else False
    return [s for s in STAGES if (s != "wy" or spec.transition.delta) and (s != "state_output" or fused)]


def per_channel(spec) -> bool:
    """Whether the spec's decay is per key channel (its kernels work on 16-row sub-blocks)."""
    return spec.transition.decay == "vector"


def backward_stages_for(spec) -> list[str]:
    """Backward stages a spec's generated chunk backward launches with backward_tiles() (none when
    its backward is not generated Triton code)."""
    from gdngen.plan import build_plan          # sympy: only when a backward is tuned
    plan = build_plan(spec)
    if plan.backward_backend != "triton":
        return []
    names = {s.name + BACKWARD_SUFFIX for s in plan.backward_stages}
    return [s for s in BACKWARD_STAGES if s in names]


def chunk_sizes(spec) -> list[int]:
    return list(spec.chunk.sizes)


def _distance(config: dict, default: dict) -> tuple:
    tiles = [k for k in sorted(default) if not isinstance(default[k], bool)]     # path switches are shared
    options = sorted((set(config) | set(default)) - set(tiles) - {k for k in default if isinstance(default[k], bool)})
    changed = sum(config[k] != default[k] for k in tiles) + sum(config.get(k, 0) != default.get(k, 0) for k in options)
    spread = sum(abs(math.log2(config[k] / default[k])) for k in tiles)
    return changed, spread, tuple(config[k] for k in tiles) + tuple(config.get(k, 0) for k in options)


def _axes(stage: str, K: int, V: int, default: dict) -> tuple:
    """(BK, BV, num_warps, num_stages) values to combine for one stage."""
    if stage in ("state", "state_output", "state_bwd"):
        bks = [max(MIN_TILE, _pow2(K))]                 # the state keeps the whole K extent
    elif stage in BACKWARD_WIDE_STAGES:
        floor = INTRA_MIN_BK if stage == "intra_bwd" else BACKWARD_MIN_WIDE_TILE
        bks = [t for t in _tiles_up_to(K) if t >= floor] or [floor]
    else:
        bks = _tiles_up_to(K)
    if not has_v_tile(stage):
        bvs = [None]
    elif stage in BACKWARD_WIDE_STAGES:
        bvs = [t for t in _tiles_up_to(V) if t >= BACKWARD_MIN_WIDE_TILE] or [BACKWARD_MIN_WIDE_TILE]
    else:
        bvs = _tiles_up_to(V)
    if stage == "state_bwd":
        pipeline = tuple(s for s in PIPELINE_STAGES if s >= 2)
    elif is_backward(stage) and stage not in _BACKWARD_PIPELINED:
        pipeline = (default["num_stages"],)             # static_range loops only: num_stages is moot
    else:
        pipeline = PIPELINE_STAGES
    return bks, bvs, WARPS, pipeline


def candidates(stage: str, *, K: int, V: int, BT: int, dtype: torch.dtype, default: dict,
               device: Optional[DeviceInfo] = None, limit: Optional[int] = None,
               pruned: Optional[list] = None, per_channel: bool = False) -> list[dict]:
    """Configs to try for one stage and shape: the default first, then the pruned space nearest it.

    ``limit`` caps the list (default included), keeping the configs closest to the default;
    ``pruned`` (a list) collects ``(config, reason)`` for everything left out. Backward stages
    (``state_bwd`` ...) take the backward default (``default_backward_tiles``); ``per_channel``
    (vector decay) adds the 16-row sub-block kernels' [16, 16, BK] products to the estimates.
    """
    shape = {"K": K, "V": V, "BT": BT, "dtype": dtype}
    out = []
    # the persistent grid where the stage's kernel has one: one program per tile (absent), or per SM counts
    persistent = (None,) + (PERSISTENT_PER_SM if stage in PERSISTENT_STAGES
                            and (PERSISTENT_STAGES[stage] or not per_channel) else ())
    for bk, bv, w, s, per_sm in itertools.product(*_axes(stage, K, V, default), persistent):
        config = {"BK": bk, "num_warps": w, "num_stages": s} if bv is None else \
            {"BK": bk, "BV": bv, "num_warps": w, "num_stages": s}
        if "TMA" in default:
            config["TMA"] = default["TMA"]              # a path choice the candidates share, not an axis
        if per_sm is not None:
            config["PERSISTENT"] = per_sm
        if config == default:
            continue
        rule = excluded(stage, config, shape)
        if rule:
            why = f"known bad: {rule.reason}"
        elif is_backward(stage) and backward_problem(stage, config, K=K, V=V):
            why = f"hard rule: {backward_problem(stage, config, K=K, V=V)}"
        else:
            why = fits(stage, config, BT=BT, dtype=dtype, device=device, per_channel=per_channel, K=K, V=V)
        if why:
            if pruned is not None:
                pruned.append((config, why))
            continue
        out.append(config)
    out.sort(key=lambda c: ("PERSISTENT" in c, _distance(c, default)))
    out.insert(0, dict(default))
    return out[:limit] if limit else out
