"""The one validation layer every generated public function calls before launching anything.

Errors are ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape or
value) and always name the offending argument together with the shapes involved.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from gdngen.spec import FEATURE_MAP_ALIASES

_NOT_GIVEN = object()     # chunk_size is checked only when the caller passes one
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
STATE_DTYPES = (torch.float32, torch.bfloat16)     # what a recurrent state pool may hold
_TRUSTED = ContextVar("gdngen_trusted_values", default=False)


class Problem(NamedTuple):
    """Sizes of one call, after validation (immutable; a named tuple, not a frozen dataclass, whose
    field-by-field construction cost every call 2 us of host time)."""

    B: int
    T: int
    H: int
    HV: int
    K: int              # the state's key dimension: q's K, or m with random features
    V: int
    N: int              # number of sequences (B, or len(cu_seqlens) - 1)
    varlen: bool
    feature_map: str = "identity"     # the spec's name of the requested feature map


@contextmanager
def trusted_values():
    """Inside the block, validation reads no tensor values (no device sync): the caller vouches for them.

    For per-step serving paths whose ``state_indices`` were checked when they were built (as
    ``gdngen.serving.StatePool.indices`` does): a decode step then never waits for the GPU.
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def values_readable() -> bool:
    """Whether validation may read tensor values on the host.

    Reading ``cu_seqlens`` or ``state_indices`` syncs with the device: under torch.compile it would
    break the graph, and during CUDA-graph capture it is an error. In those two cases (and inside
    :func:`trusted_values`) only the structural checks (rank, dtype, shape, device) run; eager
    calls get the value checks too.
    """
    if torch.compiler.is_compiling() or _TRUSTED.get():     # Dynamo cannot trace ContextVar.get
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _tensor(name: str, x, *, ndim: int | None = None, floating: bool = True) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    return x


def _shape(name: str, x: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({what}), got {tuple(x.shape)}")


# CUDA launches at most 65535 programs along a grid's 2nd and 3rd axes; the chunk stages put the
# chunks and the (sequence x value head) pairs there, so a call past it would fail inside a launch
# with "invalid argument" - say which argument instead.
GRID_ROWS = 65535


def _check_grid_rows(B: int, T: int, HV: int, N: int, chunk_size, offsets) -> None:
    """``offsets``: cu_seqlens read on the host, or None (dense, or values not readable: the packed
    chunks are then bounded by T alone, which a packed batch can exceed by at most N - 1)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        return                    # a recurrent call: its grid is one flat axis
    if max(B, N) * HV > GRID_ROWS:
        raise ValueError(f"v: {max(B, N)} sequences x HV={HV} value heads = {max(B, N) * HV} exceeds the "
                         f"{GRID_ROWS} programs a CUDA grid axis allows; call in smaller batches")
    if offsets is not None:
        chunks = sum(-(-(b - a) // chunk_size) for a, b in zip(offsets, offsets[1:]))
    else:
        chunks = -(-T // chunk_size)
    if chunks > GRID_ROWS:
        raise ValueError(f"q: T={T} makes {chunks} chunks of chunk_size={chunk_size}, past the {GRID_ROWS} "
                         f"programs a CUDA grid axis allows; use a larger chunk_size or split the sequence "
                         f"(initial_state / output_final_state carry the state across calls)")


def validate_chunk_call(
    info: dict,
    q, k, v, g=None, beta=None, *,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    chunk_size=_NOT_GIVEN,
    use_gate_in_kernel: bool = False,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    feature_map=None,
    feature_projection=None,
) -> Problem:
    """Check every argument of a generated ``chunk_*`` / ``fused_recurrent_*`` call.

    ``info`` is the spec summary a generated module embeds: ``name``, ``decay``, ``delta``,
    ``chunk_sizes``, ``max_k``, ``max_v``, ``gva``, ``input_dtypes``, ``gate_fused``,
    ``beta_sigmoid``, ``neg_eigval`` and (optional) ``feature_maps``.
    """
    q = _tensor("q", q, ndim=4)
    k = _tensor("k", k, ndim=4)
    v = _tensor("v", v, ndim=4)
    B, T, H, K = q.shape
    _shape("k", k, (B, T, H, K), "must match q [B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected shape ({B}, {T}, HV, V) to match q {tuple(q.shape)}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v: the number of value heads HV={HV} must be a multiple of the q/k heads H={H}")
    if HV != H and not info["gva"]:
        raise ValueError(f"v: spec '{info['name']}' does not allow grouped value heads (HV={HV} != H={H})")
    if not 1 <= K <= info["max_k"]:
        raise ValueError(f"q: head dim K={K} outside the spec's range [1, {info['max_k']}]")
    if not 1 <= V <= info["max_v"]:
        raise ValueError(f"v: head dim V={V} outside the spec's range [1, {info['max_v']}]")

    allowed = info["input_dtypes"]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if _DTYPE_NAMES.get(x.dtype) not in allowed:
            raise TypeError(f"{name}: dtype {x.dtype} not among the spec's input dtypes {info['input_dtypes']}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens), ("A_log", A_log), ("dt_bias", dt_bias)):
        if isinstance(x, torch.Tensor) and x.device != device:
            raise ValueError(f"{name}: on {x.device}, expected the device of q ({device})")

    decay, delta = info["decay"], info["delta"]
    if decay == "none":
        if g is not None:
            raise ValueError(f"g: spec '{info['name']}' has no decay; pass g=None")
    else:
        if g is None:
            raise ValueError(f"g: spec '{info['name']}' needs a log-decay g")
        g = _tensor("g", g)
        expected = (B, T, HV) if decay == "scalar" else (B, T, HV, K)
        _shape("g", g, expected, "[B, T, HV]" if decay == "scalar" else "[B, T, HV, K]")
    if delta:
        if beta is None:
            raise ValueError(f"beta: spec '{info['name']}' uses the delta rule and needs beta")
        beta = _tensor("beta", beta)
        _shape("beta", beta, (B, T, HV), "[B, T, HV]")
    elif beta is not None:
        raise ValueError(f"beta: spec '{info['name']}' has no delta rule; pass beta=None")

    if use_gate_in_kernel:
        if not info["gate_fused"]:
            raise ValueError(f"use_gate_in_kernel: spec '{info['name']}' has no fused gate")
        if A_log is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True")
        _shape("A_log", _tensor("A_log", A_log), (HV,), "[HV]")
        if dt_bias is not None:
            _shape("dt_bias", _tensor("dt_bias", dt_bias), (HV,), "[HV]")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log, dt_bias: only used with use_gate_in_kernel=True")
    if use_beta_sigmoid_in_kernel and not info["beta_sigmoid"]:
        raise ValueError(f"use_beta_sigmoid_in_kernel: spec '{info['name']}' takes beta as given")
    if allow_neg_eigval:
        if not info["neg_eigval"]:
            raise ValueError(f"allow_neg_eigval: spec '{info['name']}' does not allow negative eigenvalues")
        if not use_beta_sigmoid_in_kernel:
            raise ValueError("allow_neg_eigval: scales the in-kernel sigmoid; set use_beta_sigmoid_in_kernel=True")

    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if chunk_size is _NOT_GIVEN:
        pass
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {chunk_size!r}")
    elif chunk_size not in info["chunk_sizes"]:
        raise ValueError(f"chunk_size: expected one of {list(info['chunk_sizes'])}, got {chunk_size!r}")

    varlen = cu_seqlens is not None
    offsets = None
    if varlen:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens: expected a 1-D tensor, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen inputs are packed as B=1, got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: expected at least two offsets [0, ..., T]")
        N = cu_seqlens.numel() - 1
        # The offsets' values are read on the host (a device sync).  Under torch.compile they are
        # graph values: reading them would break the graph (an error with fullgraph=True), so a
        # compiled caller gets the structural checks above and not these.
        if values_readable():
            host = cu_seqlens.tolist()
            if host[0] != 0 or host[-1] != T:
                raise ValueError(f"cu_seqlens: expected to start at 0 and end at T={T}, got {host[0]} .. {host[-1]}")
            if any(b < a for a, b in zip(host, host[1:])):
                raise ValueError("cu_seqlens: offsets must be non-decreasing")
            offsets = host
    else:
        N = B

    _check_grid_rows(B, T, HV, N, chunk_size, offsets)
    feature_map, K = validate_feature_map(info, feature_map, feature_projection, q)
    if initial_state is not None:
        initial_state = _tensor("initial_state", initial_state)
        _shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]" if feature_map != "random_features"
               else "[N, HV, m, V]: the random features' dimension m is the state's key dimension")
    return Problem(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, varlen=varlen, feature_map=feature_map)


def validate_feature_map(info: dict, feature_map, feature_projection, q: torch.Tensor) -> tuple[str, int]:
    """Check ``feature_map`` / ``feature_projection``; returns (the spec's map name, the state's key dim).

    ``None`` is ``identity`` (always allowed); ``elu`` is ``elu+1``; any other map must be one the
    spec declares (``info["feature_maps"]``). ``random_features`` needs ``feature_projection``
    ``[m, K]`` (1 <= m <= the spec's max_k) on q's device; every other map refuses one.
    """
    K = q.shape[-1]
    declared = info.get("feature_maps", ["identity"])
    if feature_map is None:
        name = "identity"
    elif not isinstance(feature_map, str):
        raise TypeError(f"feature_map: expected a name (one of {declared}) or None, got {type(feature_map).__name__}")
    else:
        name = FEATURE_MAP_ALIASES.get(feature_map, feature_map)
        if name != "identity" and name not in declared:
            raise ValueError(f"feature_map: spec '{info['name']}' declares feature maps {declared}, got {feature_map!r}")
    if name != "random_features":
        if feature_projection is not None:
            raise ValueError("feature_projection: only used with feature_map='random_features'")
        return name, K
    if feature_projection is None:
        raise ValueError("feature_projection: feature_map='random_features' needs the projection W [m, K]")
    proj = _tensor("feature_projection", feature_projection, ndim=2)
    m = proj.shape[0]
    if proj.shape[1] != K or not 1 <= m <= info["max_k"]:
        raise ValueError(f"feature_projection: expected shape (m, {K}) ([m, K], 1 <= m <= {info['max_k']}), "
                         f"got {tuple(proj.shape)}")
    if proj.device != q.device:
        raise ValueError(f"feature_projection: on {proj.device}, expected the device of q ({q.device})")
    return name, m


def validate_recurrent_call(
    problem: Problem,
    device: torch.device,
    *,
    initial_state=None,
    cu_seqlens=None,
    state_indices=None,
    inplace_final_state=True,
    intermediate_states=None,
    return_intermediate_states=False,
) -> int:
    """Check the serving options of a ``fused_recurrent_*`` call (after :func:`validate_chunk_call`).

    With ``state_indices`` the ``initial_state`` is a pool ``[P, HV, K, V]`` (float32 or bfloat16,
    contiguous: it is written in place) and ``validate_chunk_call`` must have been called with
    ``initial_state=None``.  Returns the longest sequence length, the token extent of the
    intermediate states.  Reading ``state_indices`` and ``cu_seqlens`` values syncs with the device,
    so it is skipped while a CUDA graph is captured or torch.compile traces (:func:`values_readable`):
    there the slots are the caller's responsibility.
    """
    N, HV, K, V = problem.N, problem.HV, problem.K, problem.V
    readable = values_readable()
    if cu_seqlens is not None and readable:
        host = cu_seqlens.tolist()
        T_max = max((b - a for a, b in zip(host, host[1:])), default=0)
    elif cu_seqlens is not None and intermediate_states is not None:
        T_max = intermediate_states.shape[1]    # capture: the caller's buffer sets the extent
    else:
        T_max = problem.T                       # dense, or an upper bound while capturing

    if not isinstance(inplace_final_state, bool):
        raise TypeError(f"inplace_final_state: expected a bool, got {inplace_final_state!r}")
    if state_indices is None:
        if not inplace_final_state:
            raise ValueError("inplace_final_state: only used with state_indices (False = verify: the pool "
                             "is left untouched)")
    else:
        if not isinstance(state_indices, torch.Tensor):
            raise TypeError(f"state_indices: expected a torch.Tensor, got {type(state_indices).__name__}")
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"state_indices: expected int32 or int64, got {state_indices.dtype}")
        if tuple(state_indices.shape) != (N,):
            raise ValueError(f"state_indices: expected shape ({N},) (one pool slot per sequence), "
                             f"got {tuple(state_indices.shape)}")
        if state_indices.device != device:
            raise ValueError(f"state_indices: on {state_indices.device}, expected the device of q ({device})")
        if initial_state is None:
            raise ValueError("initial_state: state_indices needs the state pool [P, HV, K, V] as initial_state")
        pool = _tensor("initial_state", initial_state, ndim=4)
        if tuple(pool.shape[1:]) != (HV, K, V) or pool.shape[0] < 1:
            raise ValueError(f"initial_state: expected a pool of shape (P, {HV}, {K}, {V}) with state_indices "
                             f"([P, HV, K, V]), got {tuple(pool.shape)}")
        if pool.dtype not in STATE_DTYPES:
            raise TypeError(f"initial_state: the state pool must be float32 or bfloat16, got {pool.dtype}")
        if not pool.is_contiguous():
            raise ValueError("initial_state: the state pool must be contiguous (it is updated in place)")
        if pool.device != device:
            raise ValueError(f"initial_state: on {pool.device}, expected the device of q ({device})")
        P = pool.shape[0]
        slots = state_indices.tolist() if readable else []
        bad = [s for s in slots if not -1 <= s < P]
        if bad:
            raise ValueError(f"state_indices: values must lie in [-1, {P}) (-1 = padding; pool of P={P} slots), "
                             f"got {bad[:4]}")
        used = [s for s in slots if s >= 0]
        if len(set(used)) != len(used):
            raise ValueError(f"state_indices: two sequences share a pool slot ({slots}); their writes would race")

    if not isinstance(return_intermediate_states, bool):
        raise TypeError(f"return_intermediate_states: expected a bool, got {return_intermediate_states!r}")
    if intermediate_states is not None:
        hs = _tensor("intermediate_states", intermediate_states, ndim=5)
        if hs.shape[0] != N or hs.shape[1] < T_max or tuple(hs.shape[2:]) != (HV, K, V):
            raise ValueError(f"intermediate_states: expected shape ({N}, T_buf >= {T_max}, {HV}, {K}, {V}) "
                             f"([N, T_max, HV, K, V]), got {tuple(hs.shape)}")
        if hs.dtype not in STATE_DTYPES:
            raise TypeError(f"intermediate_states: expected float32 or bfloat16, got {hs.dtype}")
        if not hs.is_contiguous():
            raise ValueError("intermediate_states: must be contiguous (the kernel writes into it)")
        if hs.device != device:
            raise ValueError(f"intermediate_states: on {hs.device}, expected the device of q ({device})")
    return T_max
