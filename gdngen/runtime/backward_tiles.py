"""Launch parameters of the generated backward stages.

Every backward launch asks :func:`backward_tiles` for its stage's launch parameters; like
:func:`gdngen.runtime.tiles` for the forward, the answer comes from, in order:

1. an :func:`override_backward` (a test, a tile experiment, the tuner trying a candidate),
2. the user's per-device autotune cache (``$GDNGEN_CACHE_DIR``, default ``~/.cache/gdngen``),
3. the shipped table for the device family (``gdngen/autotune/shipped/``),
4. :func:`default_backward_tiles`, safe everywhere.

Steps 2-3 need the spec's name (the generated driver passes it, with H, T and the spec hash) and
a GPU; cache entries are keyed ``<spec>/<stage>_bwd/<shape class>`` (``state_bwd`` is the reverse
state pass, ``state`` the forward one) and written by ``gdngen tune --stages bwd``. An entry that
breaks a rule below is ignored with a warning, never used, never a crash.

Tile rule learned on the H200 (Triton 3.6): no [*, 32] tensor-core product may take an operand
that comes out of a 64-wide product in the same kernel. The forward output stage gave wrong rows
with BV=32 next to its [BT=64, 64] Q K^T (gdngen.autotune.space.KNOWN_BAD); the backward chunk
and wy stages at K=20 (BK=32 beside the [64, 64] dS and dA) gave wrong dk and dg while every
gradient that avoids that path was right. Hence the chunk and wy tiles never go below 64 (a K or V
below 64 is masked, not tiled narrower). The reverse state pass holds no [BT, BT] product since
the intra stage took the scores over, so any BV is allowed there.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import torch

from gdngen.autotune import cache as _cache
from gdngen.autotune import space as _space
from gdngen.runtime.launch import next_pow2
from gdngen.runtime.tiles import _RECORDERS, MEMO_LIMIT, SM_COUNT_H200

STAGES = ("wy_prep", "intra", "state", "chunk", "wy", "wy_decay")
_OVERRIDES: dict[str, dict] = {}
_ANSWERS = _cache.dependent_memo(MEMO_LIMIT)     # launch shape, device, cache folder -> backward_tiles() without overrides


def default_backward_tiles(stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype,
                           per_channel: bool = False) -> dict:
    """BK / BV / warps for one backward launch; every head dim up to 256 (tl.dot needs tiles >= 16).

    The reverse state pass keeps the whole K extent of its [K, BV] gradient slice in registers,
    like the forward state pass, and narrows BV only while that leaves too few programs.
    ``per_channel`` (vector decay): the wy_decay kernel (and the chunk kernel) unrolled 16-row
    sub-blocks and kept every [16, 16] block pair live until 2026-11-30; with 4 warps ptxas spilled
    42-44 KB per thread of them (kda, K=V=128, bf16, chunk 64: ``gdngen check --compile-sm90``),
    with 8 warps 0.9 and 7.5 KB. Both now hold whole-chunk [BT, BK] / [BT, BT] float32 tiles: the
    chunk kernel 255 registers, no spill at 8 warps (gla and kda, same shape), 1.5 KB at 4. The
    wy_decay kernel goes level by level since kda-wy-levels (stages/_channel_wy.j2): BK=64 / 8
    warps 250 registers, no spill, modelled 0.58 ms (1.35 with the 16-row blocks, 255 registers
    and 40 B; benchmarks/sass_profile.py); BK=32 / 8 warps 215 registers, 0.84 ms; BK=64 / 4
    warps spills 976 B. float32 inputs (ieee dots) spill 11 KB at BK=64 / 8 warps, none at BK=32
    (168 registers). Chunk 16 takes 4 warps (8 spilled 24 B at K=256 bf16; 4: 138 registers).
    The 16-bit default since stop 20 is BK=32 / 4 warps / one stage (the H200 sweep below), which
    ptxas puts at 255 registers and 72 B of spill: measured faster regardless.
    """
    pk, pv = max(16, next_pow2(K)), max(16, next_pow2(V))
    if stage == "state":
        bv = min(pv, 64 if pk <= 128 else 16)
        while bv > 16 and N * HV * -(-V // bv) < SM_COUNT_H200 // 2:
            bv //= 2
        # never one pipeline stage: num_stages=1 gave illegal memory accesses on the H200 (Triton
        # 3.6) at K=128 (tile sweep) and K=256 (the default there until then); with the scores
        # moved to the intra stage two stages fit at K=256 (88 KiB, gdngen check --compile-sm90).
        # Eight warps from BV=32 up: (1,32768,32,32) fwd+bwd 8.36 ms at BV=32/8 warps vs 8.57 at
        # BV=16/4 warps, and 8.58 vs 9.30 ms at BV=64 (benchmarks/profile_backward.py, NOTES.md).
        # Three stages for the scalar-decay / decay-free pass with 16-bit inputs up to K = 128: at two,
        # Triton 3.6 issues a step's copies (q, k, w, dO, dv_intra, g) at the end of the step before
        # and waits for all of them at the top of this one, so every step of the serial chain paid
        # their whole load latency; three leave one step in between. sm_90 model (sass_profile.py
        # --cp-async, GDN (1,32768,32,32), BV=32 / 8 warps): 1457 -> 1370 cycles per step at a
        # 300-cycle load latency, 1959 -> 1373 at 800; 181 KiB shared (BV=64: 214 KiB), no spill.
        # Vector decay (gla, kda) keeps two: its q / k reach the dots through registers (modelled
        # slower at three), and K = 256 or float32 tiles would not fit three stages.
        stages = 3 if not per_channel and dtype.itemsize <= 2 and pk <= 128 else 2
        return {"BK": pk, "BV": bv, "num_warps": 8 if bv >= 32 else 4, "num_stages": stages}
    if stage == "intra" and per_channel:
        # the per-channel intra kernel builds its [BT, BT] scores once, level by level (most of its
        # work), and then loops over value tiles: one tile up to V = 128. Since the scores' key
        # tiles went outer (stages/_channel_chunk_scores.j2), ptxas (Triton 3.6, sm_90, K=V=128,
        # chunk 64): bf16 BK=32 / BV=128 / 8 warps / one stage 122 registers, two programs per SM
        # (BK=64: 179, one); float32 BK=32 / BV=64 / two stages no spill (BV=128: 6 KB spilled).
        # Never below 64 in BV (the tile rule above).
        half = dtype.itemsize <= 2
        return {"BK": 32, "BV": 128 if pv >= 128 and half else 64, "num_warps": 8, "num_stages": 1 if half else 2}
    if stage == "chunk" and per_channel:
        # one pipeline stage for 16-bit inputs: gla forward+backward 5.15 ms vs 5.53 with two at
        # (4,8192,16,16) bf16 K=V=128 (H200, stop 20 sweep; BV=128 5.77, four warps 5.49)
        return {"BK": 64, "BV": 64, "num_warps": 8, "num_stages": 1 if dtype.itemsize <= 2 else 2}
    if stage in ("chunk", "wy", "intra"):
        return {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2}
    if stage == "wy_decay":
        # 16-bit inputs: BK=32, four warps, one pipeline stage - measured on the H200 (stop 20 sweep,
        # kda forward+backward, bf16 K=V=128): 9.85 ms vs 10.63 at the former BK=64 / 8 warps / two
        # stages at (4,8192,16,16), 22.55 vs 24.11 at (1,32768,32,32). float32 keeps two stages
        # (unmeasured there).
        if dtype.itemsize <= 2:
            return {"BK": 32, "num_warps": 4, "num_stages": 1}
        return {"BK": 32, "num_warps": 4 if BT == 16 else 8, "num_stages": 2}
    if stage == "wy_prep":
        return {"BK": 64, "num_warps": 4, "num_stages": 2}
    raise ValueError(f"stage: unknown backward stage {stage!r}")


# the stages whose [*, BK] / [*, BV] products sit beside a [BT, BT] one (the tile rule above)
WIDE_STAGES = ("chunk", "wy")


def _launches_on_gpu() -> bool:
    """Whether launches go to a CUDA GPU (not the CPU interpreter, where narrow tiles are safe and
    the tests use them to cover multi-tile layouts at small head dims)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()


# the stages whose kernels take a persistent grid (stages/_persistent.j2), by runtime name: stage -> whether
# a per-channel decay's kernel does too (gdngen.autotune.space.PERSISTENT_STAGES, the one table)
PERSISTENT_STAGES = {_space.runtime_stage(stage): per_channel for stage, per_channel in _space.PERSISTENT_STAGES.items()}


def _problem(stage: str, config: dict, K: int, per_channel: bool = False) -> Optional[str]:
    """What makes ``config`` unlaunchable or unsafe for ``stage`` (None when nothing does)."""
    if config.get("PERSISTENT"):
        if stage not in PERSISTENT_STAGES or (per_channel and not PERSISTENT_STAGES[stage]):
            return ("PERSISTENT: the wy_prep stage, and the chunk and wy stages of a scalar- or no-decay spec, take "
                    f"a persistent grid; not the {stage} stage{' of a per-channel decay' if per_channel else ''}")
        if not isinstance(config["PERSISTENT"], int) or isinstance(config["PERSISTENT"], bool) or config["PERSISTENT"] < 0:
            return f"PERSISTENT: expected a count of programs per SM (an int >= 0), got {config['PERSISTENT']!r}"
    for key in ("BK", "BV"):
        tile = config.get(key)
        if tile is not None and (tile < 16 or tile & (tile - 1)):
            return f"{key}: the {stage} stage needs a power of two >= 16, got {tile}"
        if tile is not None and tile < 64 and stage in WIDE_STAGES and _launches_on_gpu():
            return (f"{key}: the {stage} stage needs tiles >= 64 on a GPU (narrower ones gave wrong dk/dg "
                    f"on the H200 under Triton 3.6: the tile rule in gdngen.runtime.backward_tiles), got {tile}")
    if stage == "state" and config["BK"] < K:
        # the reverse state pass holds all K rows of its slice: a narrower BK would drop rows
        return f"BK: the state stage needs BK >= K ({K}), got {config['BK']}"
    if stage == "state" and config["num_stages"] < 2:
        return ("num_stages: the state stage needs >= 2 (one stage gave illegal memory "
                f"accesses on the H200), got {config['num_stages']}")
    return None


def backward_tiles(stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype,
                   spec_name: Optional[str] = None, H: Optional[int] = None, T: Optional[int] = None,
                   spec_hash: Optional[str] = None, per_channel: bool = False,
                   context: Optional[tuple] = None) -> dict:
    """BK / BV / num_warps / num_stages for one launch of backward ``stage``.

    The defaults, with an :func:`override_backward` for ``stage`` merged over them, else (given
    ``spec_name``, on a GPU) the tuned cache entry for this shape class. ``H``, ``T`` (only its
    short/long bucket) and ``spec_hash`` make the cache match exactly, as for ``tiles``. A bad
    override raises ValueError naming the key; a bad cache entry is ignored with a warning.
    ``context``: ``gdngen.autotune.cache.lookup_context()`` taken once per call, as for ``tiles``.
    """
    for recorder in _RECORDERS:
        recorder.append(stage + "_bwd")
    forced = _OVERRIDES.get(stage)
    if forced is not None:
        config = default_backward_tiles(stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, per_channel=per_channel)
        config.update(forced)
        problem = _problem(stage, config, K, per_channel)
        if problem:
            raise ValueError(problem)
        return config
    # memoised per launch shape, device and cache folder, like tiles() (T only through the cache's bucket)
    if context is None:
        context = _cache.lookup_context()
    key = (stage, K, V, BT, N, HV, dtype, spec_name, H, None if T is None else T <= _cache.SHORT_T, spec_hash,
           per_channel, context)
    return _ANSWERS.answer(key, lambda: _resolve(stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, spec_name=spec_name,
                                                 H=H, T=T, spec_hash=spec_hash, per_channel=per_channel,
                                                 context=context))


def _resolve(stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype, spec_name: Optional[str],
             H: Optional[int], T: Optional[int], spec_hash: Optional[str], per_channel: bool, context: tuple) -> dict:
    """backward_tiles' answer without an override: the tuned entry over the defaults, when it is safe."""
    config = default_backward_tiles(stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, per_channel=per_channel)
    device = context[0]
    if spec_name is not None and device is not None:
        chosen = _cache.lookup(spec_name, stage + "_bwd", K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, H=H, T=T,
                               spec_hash=spec_hash, device=device)
        if chosen:
            tuned = {**config, **chosen}
            problem = _problem(stage, tuned, K, per_channel)
            if problem:           # the cache's own checks should have caught it: never crash a launch
                _cache._warn_once(("backward", spec_name, stage, tuple(sorted(chosen.items()))),
                                  f"gdngen: tuned {stage}_bwd config {chosen} for {spec_name} is not safe "
                                  f"({problem}); using the defaults")
            else:
                config = tuned
    return config


@contextmanager
def override_backward(stage: str, **config):
    """Temporarily replace some launch parameters of one backward stage (all specs).

    For tests and tile experiments, e.g. multi-tile layouts at small head dims:
    ``with override_backward("chunk", BK=16, BV=32): ...``.
    """
    if stage not in STAGES:
        raise ValueError(f"stage: unknown backward stage {stage!r}")
    previous = _OVERRIDES.get(stage)
    _OVERRIDES[stage] = dict(config)
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.pop(stage, None)
        else:
            _OVERRIDES[stage] = previous
