"""Launch choices of the token-recurrent kernel (``fused_recurrent_*``): V tile and warps per program.

The recurrent kernel is a streaming read-modify-write of the state: at decode (T = 1) each program
loads a ``[K, BV]`` slice of one sequence's state, applies one token and stores it back. Two regimes:

* Many (sequence, value head) pairs (B = 64, 256 at HV = 32): bandwidth-bound. Each program's rows
  should be whole 128-byte lines (BV = 32 fp32 or 64 bf16 elements) and each thread should hold
  about 32 state values, so registers leave room for several programs per SM to keep loads in flight.
* Few pairs (B = 1): latency-bound. Narrower V tiles (down to BV = 8) spread the state over more
  programs, so each SM has less to load and reduce before the step is done.

:func:`recurrent_tiles` applies those two rules; ``gdngen.runtime.tiles.override(spec, "recurrent",
BV=..., num_warps=...)`` replaces them (the decode benchmark sweeps them this way). Each launch shape
is resolved once per process: afterwards a launch costs one dict lookup. A tuned entry
(``gdngen tune --stages recurrent``, cached as ``<spec>/recurrent/<shape class>`` keyed by the state
dtype) replaces the rule of thumb's BV and num_warps.
"""
from __future__ import annotations

import torch

from gdngen.autotune import cache as _cache
from gdngen.runtime.tiles import _OVERRIDES   # the dict tiles.override() fills
from gdngen.runtime.launch import next_pow2, sm_count

STAGE = "recurrent"
LINE_BYTES = 128              # one L2 cache line: the row segment a program should own at least
STATE_VALUES_PER_THREAD = 32  # fp32 registers of state per thread
MIN_BV = 8
_RESOLVED: dict = {}


def default_recurrent_tiles(*, N: int, HV: int, K: int, V: int, state_dtype: torch.dtype, sms: int) -> dict:
    """The rule of thumb in the module docstring, as launch parameters (BK, BV, num_warps, num_stages)."""
    BK = max(16, next_pow2(K))
    pv = max(MIN_BV, next_pow2(V))
    element = torch.finfo(state_dtype).bits // 8
    BV = min(pv, max(MIN_BV, LINE_BYTES // element))
    if BK >= 256:
        BV = min(BV, 16)      # keep the [BK, BV] tile within registers at K = 256
    # latency regime: fewer than ~4 programs per SM -> narrower tiles, more programs
    while BV > MIN_BV and N * HV * -(-V // BV) < 4 * sms:
        BV //= 2
    num_warps = max(1, min(8, BK * BV // (32 * STATE_VALUES_PER_THREAD)))
    # num_stages pipelines the token loop's loads when T > 1; T = 1 has no loop to pipeline.
    return {"BK": BK, "BV": BV, "num_warps": num_warps, "num_stages": 2}


def recurrent_tiles(spec_name: str, *, N: int, HV: int, K: int, V: int, state_dtype: torch.dtype,
                    device: torch.device) -> dict:
    """Launch parameters of one ``fused_recurrent_<spec_name>`` launch.

    On CUDA: a tuned cache entry for the shape class, else :func:`default_recurrent_tiles`. An override (``gdngen.runtime.tiles.override(spec_name, "recurrent", ...)``) is merged over the
    defaults; BK always covers K (the kernel holds whole key rows for the L2 norm and k^T S).
    """
    chosen = _OVERRIDES.get((spec_name, STAGE))
    key = (spec_name, N, HV, K, V, state_dtype, device)
    config = _RESOLVED.get(key)
    if config is None:
        if device.type == "cuda":
            config = default_recurrent_tiles(N=N, HV=HV, K=K, V=V, state_dtype=state_dtype, sms=sm_count(device))
            tuned = _cache.lookup(spec_name, STAGE, K=K, V=V, BT=0, N=N, HV=HV, dtype=state_dtype)
            if tuned:
                config.update(tuned)       # BV and num_warps from `gdngen tune --stages recurrent`
        else:
            # the interpreter pays per program, not per register: one V tile
            config = {"BK": max(16, next_pow2(K)), "BV": max(MIN_BV, next_pow2(V)), "num_warps": 1, "num_stages": 1}
        _RESOLVED[key] = config
    if chosen:
        config = {**config, **chosen, "BK": config["BK"]}
    return config


def forget() -> None:
    """Resolve every launch shape again (after a tuning run wrote the cache; tests)."""
    _RESOLVED.clear()
