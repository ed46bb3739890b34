"""Tile and launch choices per stage.

Every launch asks :func:`tiles` for its stage's launch parameters. The answer comes from, in order:

1. an explicit :func:`override` (a tuner or a benchmark trying another choice; merged over the
   defaults, so a partial override changes only the keys it names),
2. the user's per-device autotune cache (``$GDNGEN_CACHE_DIR``, default ``~/.cache/gdngen``),
3. the shipped table for the device family (``gdngen/autotune/shipped/``),
4. :func:`default_tiles`, safe everywhere.

Steps 2-3 apply only on a GPU (never to CPU tensors under the interpreter), read each file once
per process, and resolve each launch shape once; nothing is tuned inside a call (`gdngen tune`).
Steps 2-4 are memoised per launch shape and device (every launch asks: the host time of a call is
the point), and forgotten with the lookups' memo (``gdngen.autotune.cache.clear_memo``, a cache
write); an override is applied afresh on every call, so it takes effect at once and ends cleanly.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional

import torch

from gdngen.autotune import cache as _cache
from gdngen.autotune.device import current_device
from gdngen.runtime.launch import next_pow2

_OVERRIDES: dict[tuple[str, str], dict] = {}
_RECORDERS: list[list] = []
MEMO_LIMIT = 4096                      # shapes kept before the memo starts over (varlen meets many N)
_ANSWERS = _cache.dependent_memo(MEMO_LIMIT)   # launch shape, device, cache folder -> tiles() without overrides


SM_COUNT_H200 = 132


def default_tiles(stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype,
                  per_channel: bool = False, solve: Optional[str] = None, writes_wu: bool = False) -> dict:
    """Launch parameters that compile for every head dim up to 256 (tl.dot needs tiles >= 16).

    The numbers come from the stage sweep on the H200 (benchmarks/NOTES.md): the WY stage is
    latency-bound and prefers one warp (two for float32 inputs); the state pass wants wide V tiles only while that still
    leaves a program per SM; the output stage prefers one V tile per chunk (QK^T computed once).
    """
    pk, pv = max(16, next_pow2(K)), max(16, next_pow2(V))
    if stage == "wy":
        if per_channel:
            # vector decay: A is built level by level on whole-chunk [BT, BK] tiles
            # (stages/_channel_chunk_scores.j2, log2(BT) exponent tiles and dots per key tile).
            # sm_90, Triton 3.6, K=V=128 bf16, chunk 64: BK=32 with 8 warps 127 registers, no
            # spill, 2 programs per SM, modelled 0.39 ms at (4,8192,16,16) (0.69 before the
            # levels); BK=32/4 warps 216 registers 0.50 ms, BK=64/8 warps 171 registers (one
            # program per SM) 0.53 ms, BK=64/4 warps 248 registers 0.54 ms (benchmarks/sass_profile.py).
            # Measured on the H200 (stop 20 sweep, whole kda forward, bf16): one pipeline stage wins
            # everywhere - BK=32/4 warps 2.71 ms vs 2.99 with two stages at (4,8192,16,16), 6.50 vs
            # 7.05 at (1,32768,32,32); BK=32/8 warps/one stage 2.75 / 6.56. float32 unmeasured.
            # Since the stage also builds the output's scores A_qk (plan: aqk_from_wy, same dots):
            # BK=32/4 warps 238 registers, modelled 0.74 ms (0.58 before); 8 warps 125 registers,
            # 0.44 (0.41 before) - worth a new sweep of the warps on the H200.
            return {"BK": min(32, pk), "num_warps": 4, "num_stages": 1}
        # One warp for 16-bit inputs: the whole (4,8192,16,32) bf16 forward 0.547 ms against 0.605 at
        # two warps (H200, stop 39 sweep; offline sm_90 182 registers, no spill). float32 inputs keep
        # two warps: one would need more than 255 registers. So do a launch that writes W and U
        # (``writes_wu``) and one that solves in float32 (``solve`` "ieee": the backward's float32 T): at
        # one warp delta_rule's spilled 516-712 B and 1688 B, at two none (offline sm_90a, Triton 3.6,
        # with TMA, (2, *, 2, 4) K=V=128; stop 56, unmeasured on the H200). T alone in fp16 or tf32 fits
        # one warp (8-52 B at G_SHARE = 2).
        # 16-bit inputs take their key tiles by TMA through a host descriptor, whole [BT, K] tiles up
        # to K = 128 (the module drops TMA where BK does not divide K; stop 47, benchmarks/NOTES.md).
        if dtype.itemsize <= 2:
            warps = 2 if writes_wu or solve == "ieee" else 1
            return {"BK": min(128, pk), "num_warps": warps, "num_stages": 2, "TMA": True}
        return {"BK": min(64, pk), "num_warps": 2, "num_stages": 2}
    if stage == "state_output":
        # The state pass writing the output too (a forward nothing differentiates, fused_output):
        # value tiles of at most 32 and two pipeline stages. H200, K=V=128 bf16, forward ms with
        # BV = 32 / 64 / 16 (4 warps, 2 stages; 8 warps at BV=32 was 1.7-1.8x slower everywhere):
        # (1,32768,32,32) 1.098 / 1.150 / 1.476, (4,8192,16,32) 1.015 / 1.109 / 1.444, (1,131072,16,32)
        # 4.147 / 4.503 / 5.973, (8,2048,16,16) 0.285 / 0.296 / 0.385, (1,32768,2,8) 0.287 / 0.299 /
        # 0.387; three stages at (1,32768,32,32): 186 registers and one program per SM (offline SASS),
        # 1.06 ms against 0.90 with two in a stand-in run (benchmarks/fused_probe.py, stop 27).
        # TMA (16-bit inputs; gdngen.runtime.tma drops it where descriptors cannot address the tiles):
        # the loop's tiles through tensor descriptors, 166 -> 144 registers and a seventh of the
        # global-load instructions (offline SASS); (1,32768,32,32) 1.097 -> 1.009 ms, bitwise the
        # same output (stop 28, fused_probe.py). The unfused state pass (3 stages) lost with it:
        # forward + backward 5.53 -> 5.86 ms, so "state" keeps pointer loads.
        config = default_tiles("state", K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, per_channel=per_channel)
        return dict(config, BV=min(32, config["BV"]), num_stages=2,
                    TMA=dtype in (torch.bfloat16, torch.float16))
    if stage == "state":
        # the whole K extent of the state stays in registers: narrow V tiles for large K
        bv = min(pv, 64 if pk <= 128 else 16)
        while bv > 16 and N * HV * -(-V // bv) < SM_COUNT_H200 // 2:
            bv //= 2
        # Each pipeline stage streams whole key rows (plus, with per-channel decay, a float32
        # [BT, K] decay tile): past 256 bytes per key row three stages overflow Hopper's 227 KiB
        # (gla bf16 K=256: 232 KiB on the H200; kda fp32 K=128: 237 KiB compiled for sm_90 with
        # Triton 3.6). Two stages otherwise, never one: a one-stage state pass hit an illegal
        # memory access on the H200 (GDN bf16 K=128, stop 19 sweep; the backward's since stop 15).
        # At float32 K=256 (BV=16) two stages compile to 149 / 217 / 197 KiB for GDN / kda / gla.
        row_bytes = pk * dtype.itemsize
        stages = 3 if row_bytes <= 256 else 2
        return {"BK": pk, "BV": bv, "num_warps": 4, "num_stages": stages}
    if stage == "output":
        # BV >= 64: BK=64 with BV=32 gave wrong outputs (K=64, V=32, bf16) under Triton 3.6 on Hopper
        if per_channel:
            # vector decay: log2(BT) level passes over K tiles build the scores. BK=32 and 8 warps:
            # 115 registers, two programs per SM, modelled 0.32 ms at (4,8192,16,16) K=V=128 bf16
            # chunk 64 against 0.54 at BK=64 (160 registers, one per SM) and 0.79 before the
            # levels (benchmarks/results/2026-11-30-offline-gla-output-bwd-sass.md). Every product
            # stays >= 64 wide in N (the Hopper miscompile above had a 32-wide one). One pipeline
            # stage for 16-bit inputs: measured on the H200 (stop 18 sweep, whole forward at
            # (4,8192,16,16) bf16) gla 1.57 ms vs 2.02 with two, kda 3.47 vs 3.92; float32 unmeasured.
            # Four warps since the key tiles went outer (one load of q, k, g per key tile): the
            # stage alone 900 us vs 1431 with eight at (4,8192,16,16), 1792 vs 2829 at
            # (1,32768,32,32) (H200, benchmarks/exp_channel_output.py; BK=32, BV=128, one stage).
            # float32 (ptxas only): BV=64 / eight warps / two stages spills 1.2 KB, BV=128 13-30 KB.
            # The numbers above are the level kernel's (gla). With the delta rule (kda) the wy stage
            # builds the scores (plan: aqk_from_wy) and this kernel only loads them: sm_90, Triton
            # 3.6, (4,8192,16,16) K=V=128 bf16 chunk 64: 128 registers, no spill, modelled 0.06 ms
            # plus memory traffic (BK=64 / two stages modelled alike); float32 BT=64 94 registers
            # (1.2 KB spill with the levels). Unmeasured on the H200.
            if dtype in (torch.bfloat16, torch.float16):
                return {"BK": min(32, pk), "BV": max(64, min(128, pv)), "num_warps": 4, "num_stages": 1}
            return {"BK": min(32, pk), "BV": 64, "num_warps": 8, "num_stages": 2}
        return {"BK": min(64, pk), "BV": max(64, min(128, pv)), "num_warps": 4, "num_stages": 3}
    raise ValueError(f"stage: unknown stage {stage!r}")


def wy_head_group(config: dict, *, H: int, HV: int, key_dtype: torch.dtype, t_dtype: torch.dtype,
                  store_wu: bool, store_scores: bool) -> int:
    """How many value heads one program of the forward wy stage takes (its ``G_SHARE``): 2 where pairs of value
    heads share a key head (HV = 2 H), else 1. Those heads' A = strictLower(diag(beta) (K K^T) * decay)
    differ only in beta and the decay, so such a program forms the key products K K^T once and solves each
    head's T from them: the grid becomes (chunks, B * H).

    Only for the launch that was measured: 16-bit keys and T, T alone (no W, U or output scores written) and
    one warp (``config["num_warps"] == 1``, the 16-bit default). There, on sm_90 (Triton 3.6), two heads take
    255 registers and 8 bytes of stack against one head's 182, and on the H200 the stage ran 472.1 -> 425.2 us
    at (1,131072,16,32), 114.8 -> 106.2 at (4,8192,16,32) and 64.2 -> 60.2 at (8,2048,16,32), T bitwise
    (benchmarks/NOTES.md, stop 52). Two warps a program ran slower (561.4 at (1,131072,16,32)). Groups of two
    only: four heads a program compiled to 32 bytes of stack offline and were not timed."""
    half = (torch.bfloat16, torch.float16)
    if (HV != 2 * H or store_wu or store_scores or key_dtype not in half or t_dtype not in half
            or config.get("num_warps") != 1):
        return 1
    return 2


def store_wu(spec_name: str, *, N: int, HV: int, per_channel: bool = False) -> bool:
    """Whether the delta rule's wy stage writes W and U (True) or only T = (I + A)^-1 (False).

    Writing only T saves memory traffic (BT values per token instead of K + V) but puts one more
    dot on the state pass's sequential chain. With few sequences x heads the state pass runs on a
    fraction of the SMs and that chain is the critical path, so W and U pay off there
    (H200, K=V=128: (1,32768,2,8) 0.82 ms with W/U vs 0.99 ms with T; with N*HV >= 32, T wins:
    (4,8192,16,32) 1.39 vs 1.69 ms - benchmarks/NOTES.md, run 6). ``per_channel`` (decay per key
    channel): always T, for precision (below). ``override(spec, "store_wu", value=...)`` forces
    either path; :func:`decide_as_for` (``override(spec, "store_wu", N=...)``) decides as for a call
    over another number of sequences.

    The two paths round differently (W and U to the input dtype one by one, or V - K~ S in float32
    before one rounding): with bf16 inputs their outputs differ by about bf16's own error against
    float64 (gated_delta_rule (1,32768,2,8) K=V=128 on the H200: 2.66e-3, each path ~3.4e-3 from
    float64). So the same sequence gives different bf16 outputs in a batch of 1 and of 4; callers
    that must match another call's numerics (the sequence split) pin the decision to that call's N.
    """
    forced = _OVERRIDES.get((spec_name, "store_wu"))
    if forced is not None and "value" in forced:
        return bool(forced["value"])
    if forced is not None and "N" in forced:
        N = int(forced["N"])
    if per_channel:
        # decay per key channel: W and U rounded to the input dtype one by one lose what the T path
        # keeps (V - K~ S subtracted in float32 before one rounding): kda bf16, K=20, V=100, B=1,
        # H=2, HV=4: o error 5.10e-3 with W/U (5.097e-3 measured on the H200), 4.60e-3 with T
        # (CPU, bf16-faithful interpreter) against issue #7's 5e-3 bar. Precision first here.
        return False
    return N * HV < 32


# A piece shorter than this many chunks would spend too much of its pass walking back
# (the walk covers a few chunks at realistic gates: a chunk of 64 tokens at g ~ -0.13 decays by e^-8).
MIN_PIECE_CHUNKS = 32


def state_pieces(spec_name: str, *, N: int, HV: int, V: int, T: int, BT: int, value_tile,
                 engage_below: float = 1.0, per_sm: int = 2) -> int:
    """How many pieces the state pass cuts each of ``N`` padded sequences into (1: none).

    The pass runs one program per sequence, value head and value tile along the whole sequence: with
    fewer programs than SMs most of the GPU idles on its sequential chain ((1, 32768, 32, 32): 64
    programs on 132 SMs). Cut into pieces, it runs up to two programs per SM, each piece starting from
    a walk over the chunks beside it that stops once their transitions' norm is at most
    :func:`window_log_tolerance` (stages/state.py.j2, stages/backward_state.py.j2). ``value_tile(n)``:
    the pass's value tile BV for a launch over n sequences (tiles depend on it). The count is a power
    of two, the largest whose programs fit ``per_sm`` per SM, and no piece is shorter than
    :data:`MIN_PIECE_CHUNKS` chunks (H200, K=V=128, bf16: 3 and 5 pieces ran slower than 2 and 4 at
    (1,32768,32,32); 4 and 8 were best at 32 x 64 and 32 x 8 programs - benchmarks/NOTES.md, stop 25).
    ``engage_below``: cut only where the unsplit pass has fewer programs than this fraction of the
    SMs (the reverse pass passes 0.5: at (1,32768,32,32) its 4096-token time segments have 128
    programs, and 2 pieces each made it slower, 836 -> 955 us). ``per_sm``: the programs an SM holds
    (2; the Gluon pass's shared memory allows 1: 4 pieces, not 8, at (1,32768,32,32), where 2 and 8
    ran 1.33 and 0.885 ms against 0.887 - stop 34). ``override(spec, "state_pieces",
    value=n)`` forces n (tests, the tuner); on CPU the default is 1.
    """
    forced = _OVERRIDES.get((spec_name, "state_pieces"))
    if forced is not None:
        return max(1, int(forced["value"]))
    device = current_device()
    if device is None:
        return 1
    sms = device.sm_count or SM_COUNT_H200

    def programs(pieces: int) -> int:
        return N * pieces * HV * -(-V // value_tile(N * pieces))

    if programs(1) >= sms * engage_below:
        return 1
    most = min(per_sm * sms // (N * HV), -(-T // BT) // MIN_PIECE_CHUNKS)
    pieces = 1 << (most.bit_length() - 1) if most > 1 else 1
    while pieces > 1 and programs(pieces) > per_sm * sms:
        pieces //= 2
    return pieces


# Token-heads (B * T * HV) up to which a forward nothing differentiates computes its output in the
# state pass (H200, K=V=128, bf16, stop 25 call 6): the fused pass ran no faster on the GPU (its chain
# holds the output's products: (1,32768,32,32) 1021 us against 968 for state + output, (1,131072,16,32)
# +4%, (1,32768,2,8) -3%), but it is one launch fewer, which is what a host-bound call pays for:
# (8,2048,16,16) 0.567 -> 0.382 ms.
FUSED_OUTPUT_MAX_TOKEN_HEADS = 1 << 19


def fused_output(spec_name: str, *, B: int, T: int, HV: int, scores_loaded: bool = False) -> bool:
    """Whether a forward that keeps no states for a backward lets its state pass write the output;
    ``override(spec, "fused_output", value=...)`` forces it.

    ``scores_loaded`` (the delta rule: plan's fused_scores_from_wy): the wy stage writes the output's
    scores and the Triton pass loads them (the Gluon pass forms them from its own tiles); then always. H200, K=V=128 bf16, forward ms unfused -> fused
    (state_output tiles BV=32, 4 warps, 2 stages): (1,32768,32,32) 1.199 -> 1.098, (4,8192,16,32)
    1.079 -> 1.015, (1,131072,16,32) 4.888 -> 4.147, (8,2048,16,16) 0.308 -> 0.285, (1,32768,2,8)
    0.362 -> 0.287 (benchmarks/fused_probe.py, stop 27). Otherwise the pass forms Q K^T and its
    exponents per value tile itself, and only short passes gain
    (:data:`FUSED_OUTPUT_MAX_TOKEN_HEADS`)."""
    forced = _OVERRIDES.get((spec_name, "fused_output"))
    if forced is not None:
        return bool(forced["value"])
    return scores_loaded or B * T * HV <= FUSED_OUTPUT_MAX_TOKEN_HEADS


def keep_values(spec_name: str) -> bool:
    """Whether a delta-rule forward that keeps states for a backward keeps its V_new too (the
    values the state pass wrote, in v's dtype), so the backward's wy_prep forms W alone instead of
    re-reading the chunk-start states and v for V_new = U - W h; ``override(spec, "keep_values",
    value=False)`` makes the backward recompute it. Memory: one more tensor of v's size kept from the
    forward to the backward (256 MiB at (1, 32768, 32, 32), V = 128, bf16), and no V_new per backward
    time segment. Bytes wy_prep stops moving at that shape: h 512 MiB, v and V_new 256 MiB each
    (stop 29; its H200 time is not measured yet: benchmarks/NOTES.md). The gradients do not change:
    the state pass forms V_new from the state rounded as the kept states are, so the recompute gave
    the same V_new (bitwise, on the bf16-faithful interpreter)."""
    forced = _OVERRIDES.get((spec_name, "keep_values"))
    if forced is not None:
        return bool(forced["value"])
    return True


def window_log_tolerance(dtype: torch.dtype) -> float:
    """The log of the largest share of an older state a piece's walk back may drop: 400x below the
    unit roundoff of the inputs' dtype (bf16 ~2.0e-5, fp16 ~2.4e-6, fp32 ~3.0e-10)."""
    return math.log(torch.finfo(dtype).eps) - 6.0


def tiles(spec_name: str, stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype: torch.dtype,
          H: Optional[int] = None, T: Optional[int] = None, spec_hash: Optional[str] = None,
          per_channel: bool = False, context: Optional[tuple] = None, solve: Optional[str] = None,
          writes_wu: bool = False) -> dict:
    """Launch parameters (BK, BV, num_warps, num_stages) for one launch of ``stage`` (``wy``,
    ``state``, ``output``, or ``state_output``: the state pass when it also writes the output).

    ``H`` (query heads), ``T`` (sequence length, only its short/long bucket is used) and
    ``spec_hash`` are optional: with them the cache lookup matches exactly; without them the
    tuned entry for any H / T bucket of this shape class is used and the hash comes from the
    loaded ``generated.<spec_name>`` module (or the catalogue spec). ``per_channel``: the spec's
    decay is per key channel (its own defaults where that changes the kernel's register needs).
    ``context``: ``gdngen.autotune.cache.lookup_context()`` taken once by a caller that launches
    several stages (default: taken here; it reads the device and an environment variable).
    ``solve``, ``writes_wu``: the wy stage's solve precision (gdngen.runtime.launch.solve_precision) and
    whether it writes W and U, which set its default warps.
    """
    for recorder in _RECORDERS:
        recorder.append(stage)
    forced = _OVERRIDES.get((spec_name, stage))
    if forced is not None:
        config = default_tiles(stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, per_channel=per_channel,
                               solve=solve, writes_wu=writes_wu)
        config.update(forced)
        return config
    if context is None:
        context = _cache.lookup_context()
    # T counts only through the cache's short / long bucket
    key = (spec_name, stage, K, V, BT, N, HV, dtype, H, None if T is None else T <= _cache.SHORT_T, spec_hash,
           per_channel, context, solve, writes_wu)

    def resolve():
        config = default_tiles(stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, per_channel=per_channel,
                               solve=solve, writes_wu=writes_wu)
        device = context[0]
        tuned = _cache.lookup(spec_name, stage, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, H=H, T=T,
                              spec_hash=spec_hash, device=device) if device is not None else None
        if tuned:
            config.update(tuned)
        return config

    return _ANSWERS.answer(key, resolve)


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


@contextmanager
def decide_as_for(spec_name: str, *, N: int):
    """Inside the block, ``spec_name``'s N-dependent path choices (:func:`store_wu`) are made as for
    a call over ``N`` sequences, whatever the batch of the calls made (an explicit
    ``override(spec, "store_wu", value=...)`` stands). The sequence split runs one sequence as a
    batch of pieces; pinned to the unsplit call's N it takes the unsplit call's path, so its bf16
    outputs match that call's to rounding at the piece boundaries, not to the paths' difference."""
    if (spec_name, "store_wu") in _OVERRIDES:
        yield
        return
    with override(spec_name, "store_wu", N=N):
        yield


@contextmanager
def record_stages():
    """Collect the stage names that ask for tiles inside the block (in launch order); backward
    launches (``backward_tiles``) are recorded with a ``_bwd`` suffix (``state_bwd``)."""
    seen: list = []
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        _RECORDERS.remove(seen)
