"""Per-device JSON cache of tuned launch configs, plus the shipped tables, and the lookup tiles() uses.

One file per device, ``$GDNGEN_CACHE_DIR/<device slug>.json`` (default ``~/.cache/gdngen``), e.g.
``nvidia-h200-sm90.json``; shipped tables live in ``gdngen/autotune/shipped/<family>.json``. Both
have the same readable layout::

    {"format": 1, "device": "NVIDIA H200", "capability": [9, 0],
     "entries": {"gated_delta_rule/state/H=16,HV=32,K=128,V=128,dtype=bfloat16,BT=64,par=high,T=long":
                 {"config": {"BK": 128, "BV": 64, "num_warps": 4, "num_stages": 3},
                  "spec_hash": "21f8afa1ca95e115", "triton": "3.6.0", "ms": 1.61, "default_ms": 1.69, ...}}}

An entry is keyed by spec name, stage and *shape class*. The stage is a forward stage (``wy``,
``state``, ``output``, ``state_output``: the state pass that writes the output), a backward one with
a ``_bwd`` suffix (``wy_prep_bwd``, ``intra_bwd``, ``state_bwd``, ``chunk_bwd``, ``wy_bwd``,
``wy_decay_bwd``: read by ``backward_tiles``), or chunk-size
advice (``chunk``: fastest forward, ``chunk_train``: fastest forward + backward). The shape class
is what changes the compiled code (H, HV, K, V, dtype, chunk size) plus two coarse buckets - how many (sequence, value head) programs there are
relative to the SM count, and whether sequences are short (T <= 4096) or long. Never the exact
sequence length. Device name, compute capability, triton version and spec hash are checked on
read: a file or entry made elsewhere is ignored with one warning, never used, never a crash.

Lookups are memoised per process: the files are read once, and each distinct launch shape is
resolved once; after that a launch costs a dict lookup. Nothing is ever tuned inside a user's call.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from gdngen.autotune.device import DeviceInfo, current_device
from gdngen.autotune.space import STAGES, excluded, has_config_keys, is_valid

FORMAT = 1
SHORT_T = 4096
ADVICE_STAGES = ("chunk", "chunk_train")     # chunk-size advice: forward, forward + backward
SPLIT_STAGE = "split"                         # segments per sequence of the intra-card split (gdngen.parallel)
RECURRENT_STAGE = "recurrent"                 # V tile and warps of fused_recurrent_* (decode)
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
CONFIG_KEYS = ("BK", "BV", "num_warps", "num_stages")


class CacheWarning(UserWarning):
    """A cache file or entry was ignored (corrupt, stale, or made for another device)."""


# ---- shape classes -------------------------------------------------------------------------

def t_bucket(T: int) -> str:
    return "short" if T <= SHORT_T else "long"


def par_bucket(programs: int, sm_count: int) -> str:
    """How many (sequence, value head) pairs there are per SM: the state pass runs one program per
    pair and V tile, so this decides whether narrow V tiles are needed to fill the GPU."""
    if programs * 2 < sm_count:
        return "low"
    if programs < 2 * sm_count:
        return "mid"
    return "high"


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def shape_class(*, H: Optional[int], HV: int, K: int, V: int, dtype, BT: int, N: int, T: Optional[int],
                sm_count: int) -> str:
    """``H=16,HV=32,K=128,V=128,dtype=bfloat16,BT=64,par=high,T=long`` (N*HV programs, T bucketed)."""
    h = "*" if H is None else str(H)
    t = "*" if T is None else t_bucket(T)
    return (f"H={h},HV={HV},K={K},V={V},dtype={dtype_name(dtype)},BT={BT},"
            f"par={par_bucket(N * HV, sm_count)},T={t}")


def entry_key(spec_name: str, stage: str, shape: str) -> str:
    return f"{spec_name}/{stage}/{shape}"


def _parse_key(key: str) -> Optional[tuple[str, str, dict]]:
    try:
        spec_name, stage, shape = key.split("/")
        fields = dict(part.split("=", 1) for part in shape.split(","))
    except ValueError:
        return None
    if set(fields) != {"H", "HV", "K", "V", "dtype", "BT", "par", "T"}:
        return None
    return spec_name, stage, fields


# ---- locations -----------------------------------------------------------------------------

def cache_dir(override: Optional[str | os.PathLike] = None) -> Path:
    if override is not None:
        return Path(override)
    env = os.environ.get("GDNGEN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gdngen"


def user_cache_path(device: DeviceInfo, directory: Optional[str | os.PathLike] = None) -> Path:
    return cache_dir(directory) / f"{device.slug}.json"


def shipped_path(device: DeviceInfo) -> Path:
    return SHIPPED_DIR / f"{device.family}.json"


# ---- reading -------------------------------------------------------------------------------

_WARNED: set = set()


def _warn_once(tag, message: str) -> None:
    if tag in _WARNED:
        return
    _WARNED.add(tag)
    warnings.warn(message, CacheWarning, stacklevel=4)


def _check_entry(entry) -> bool:
    if not isinstance(entry, dict):
        return False
    config = entry.get("config")
    if not isinstance(config, dict) or not config or set(config) - set(CONFIG_KEYS) - {"chunk_size", "segments", "PERSISTENT"}:
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in config.values()):
        return False
    return isinstance(entry.get("spec_hash"), str) and isinstance(entry.get("triton"), str)


def validate_document(doc) -> Optional[str]:
    """None when ``doc`` is a well-formed cache document, else what is wrong with it."""
    if not isinstance(doc, dict):
        return "top level is not an object"
    if doc.get("format") != FORMAT:
        return f"format {doc.get('format')!r}, expected {FORMAT}"
    if not isinstance(doc.get("device"), str) or not (
            isinstance(doc.get("capability"), list) and len(doc["capability"]) == 2
            and all(isinstance(c, int) for c in doc["capability"])):
        return "device name or capability missing or of the wrong type"
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return "'entries' is not an object"
    for key, entry in entries.items():
        if _parse_key(key) is None or not _check_entry(entry):
            return f"entry {key!r} is malformed"
    return None


def _read(path: Path) -> Optional[dict]:
    """The document at ``path``; None (after one warning) when it is corrupt, None when absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn_once(("read", str(path)), f"gdngen: cannot read tile cache {path} ({exc}); ignoring it")
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        _warn_once(("corrupt", str(path)), f"gdngen: tile cache {path} is not valid JSON ({exc}); ignoring it "
                   "(delete it or rerun `gdngen tune`)")
        return None
    problem = validate_document(doc)
    if problem:
        _warn_once(("corrupt", str(path)), f"gdngen: tile cache {path} is corrupt ({problem}); ignoring it "
                   "(delete it or rerun `gdngen tune`)")
        return None
    return doc


class _Table:
    """One loaded file, indexed by everything but the fields a launch may not know (H, T)."""

    def __init__(self, path: Path, doc: dict):
        self.path = path
        self.index: dict[tuple, list] = {}
        for key, entry in sorted(doc["entries"].items()):
            spec_name, stage, f = _parse_key(key)
            ident = (spec_name, stage, f["HV"], f["K"], f["V"], f["dtype"], f["BT"], f["par"])
            self.index.setdefault(ident, []).append((f["H"], f["T"], key, entry))

    def find(self, ident: tuple, H: Optional[int], T: Optional[int]) -> list:
        """Entries for ``ident``, best match first: exact H and T bucket; unknown ones match any
        (then long sequences first - what a tuned table mostly serves - then by key)."""
        rows = self.index.get(ident, [])
        want_h = None if H is None else str(H)
        want_t = None if T is None else t_bucket(T)
        hits = [r for r in rows if (want_h is None or r[0] == want_h) and (want_t is None or r[1] == want_t)]
        return sorted(hits, key=lambda r: (r[1] != "long", r[2]))


_TABLES: dict[str, Optional[_Table]] = {}
_RESOLVED: dict[tuple, Optional[dict]] = {}
_MISSING = object()
_SPEC_HASHES: dict[str, Optional[str]] = {}


def _table(path: Path, device: DeviceInfo, shipped: bool) -> Optional[_Table]:
    key = str(path)
    if key in _TABLES:
        return _TABLES[key]
    table = None
    doc = _read(path)
    if doc is not None:
        same = (doc["device"] == device.name if not shipped else
                DeviceInfo(doc["device"], tuple(doc["capability"])).family == device.family)
        if not same or tuple(doc["capability"]) != tuple(device.capability):
            _warn_once(("device", key), f"gdngen: tile cache {path} was made on {doc['device']} "
                       f"sm{doc['capability'][0]}{doc['capability'][1]}, not this {device.name} "
                       f"sm{device.capability[0]}{device.capability[1]}; ignoring it")
        else:
            table = _Table(path, doc)
    _TABLES[key] = table
    return table


# Memos of answers built on lookups (gdngen.runtime.tiles' per-launch configs): emptied with _RESOLVED
_DEPENDENT_MEMOS: list[dict] = []


class DependentMemo(dict):
    """Memoised launch answers that depend on lookups: emptied whenever the lookups' memo is
    (:func:`clear_memo`, :func:`write_entries`), and when it holds ``limit`` keys (varlen meets many N)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def answer(self, key, compute) -> dict:
        """The caller's own copy of the answer for ``key``, computed by ``compute()`` the first time."""
        config = self.get(key)
        if config is None:
            config = compute()
            if len(self) >= self.limit:
                self.clear()
            self[key] = config
        return dict(config)


def dependent_memo(limit: int = 4096) -> DependentMemo:
    """A :class:`DependentMemo`, registered to be emptied with the lookups' memo."""
    memo = DependentMemo(limit)
    _DEPENDENT_MEMOS.append(memo)
    return memo


_GENERATION = [0]      # bumped whenever resolved launches are forgotten (a cache written, cleared)


def _forget_resolved() -> None:
    _RESOLVED.clear()
    for memo in _DEPENDENT_MEMOS:
        memo.clear()
    _GENERATION[0] += 1


def generation() -> int:
    """A count that changes whenever the launches resolved so far may change (a cache file written, the memo
    cleared): a replayed launch sequence (gdngen.runtime.graphs) keys on it."""
    return _GENERATION[0]


def lookup_context() -> tuple:
    """What a lookup's answer depends on beyond its arguments and the files: ``(device, cache folder
    or None)``, the folder only with a device (without one nothing is looked up). A caller making
    several launches takes it once per call and hands it to each (``tiles(..., context=)``)."""
    device = current_device()
    return (device, os.environ.get("GDNGEN_CACHE_DIR")) if device is not None else (None, None)


def clear_memo() -> None:
    """Forget loaded files, resolved launches and given warnings (after writing a cache, in tests)."""
    _TABLES.clear()
    _forget_resolved()
    _SPEC_HASHES.clear()
    _WARNED.clear()


def spec_hash_for(spec_name: str) -> Optional[str]:
    """The hash of the spec a launch belongs to: the loaded ``generated.<name>`` module's SPEC,
    else the catalogue's ``specs/<name>.yaml``; None when neither is known (no cache applies)."""
    if spec_name in _SPEC_HASHES:
        return _SPEC_HASHES[spec_name]
    found = None
    module = sys.modules.get(f"generated.{spec_name}")
    spec = getattr(module, "SPEC", None)
    if spec is not None and getattr(spec, "name", None) == spec_name:
        found = spec.hash
    else:
        path = Path(__file__).resolve().parent.parent.parent / "specs" / f"{spec_name}.yaml"
        if path.exists():
            try:
                from gdngen.spec import load_spec
                found = load_spec(path).hash
            except Exception:  # noqa: BLE001 - an unreadable spec only means: no cache for it
                found = None
    _SPEC_HASHES[spec_name] = found
    return found


def _triton_version() -> str:
    import triton
    return triton.__version__


def _usable(table: _Table, key: str, entry: dict, *, spec_name: str, stage: str, spec_hash: str,
            K: int, V: int, BT: int, dtype) -> bool:
    where = str(table.path)
    if entry["spec_hash"] != spec_hash:
        _warn_once(("spec", where, spec_name), f"gdngen: tile cache {table.path} has entries for spec "
                   f"{spec_name} hash {entry['spec_hash']}, but the spec is now {spec_hash}; ignoring them "
                   "(rerun `gdngen tune`)")
        return False
    if entry["triton"] != _triton_version():
        _warn_once(("triton", where), f"gdngen: tile cache {table.path} was tuned with triton {entry['triton']}, "
                   f"this is triton {_triton_version()}; ignoring its entries (configs miscompile differently "
                   "across versions: rerun `gdngen tune`)")
        return False
    config = dict(entry["config"])
    if stage in ADVICE_STAGES:
        ok = set(config) == {"chunk_size"}
    elif stage == RECURRENT_STAGE:
        bv, warps = config.get("BV"), config.get("num_warps")
        ok = (set(config) == {"BV", "num_warps"} and isinstance(bv, int) and 8 <= bv <= 256 and bv & (bv - 1) == 0
              and warps in (1, 2, 4, 8))
    elif stage == SPLIT_STAGE:
        segments = config.get("segments")
        ok = (set(config) == {"segments"} and isinstance(segments, int) and not isinstance(segments, bool)
              and segments >= 1)
    else:
        # no V tile in wy, wy_prep_bwd, wy_decay_bwd; is_valid holds the backward's hard rules
        ok = (has_config_keys(stage, config) and is_valid(stage, config, K=K, V=V)
              and excluded(stage, config, {"K": K, "V": V, "BT": BT, "dtype": dtype}) is None)
    if not ok:
        _warn_once(("invalid", where, key), f"gdngen: tile cache {table.path} entry {key} holds "
                   f"{config}, which is not a valid or safe config for it; ignoring it")
    return ok


def lookup(spec_name: str, stage: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype,
           H: Optional[int] = None, T: Optional[int] = None, spec_hash: Optional[str] = None,
           device: Optional[DeviceInfo] = None, directory: Optional[str | os.PathLike] = None) -> Optional[dict]:
    """The tuned config for one launch: user cache, then the shipped table; None when neither has one.

    Returns None without touching any file when there is no GPU (CPU tensors, interpreter).
    """
    device = device if device is not None else current_device()
    if device is None:
        return None
    # the memo key is built from cheap values only (no Path, no device slug): this runs per launch
    where = directory if directory is not None else os.environ.get("GDNGEN_CACHE_DIR")
    memo = (spec_name, stage, K, V, BT, N, HV, dtype, H, None if T is None else T <= SHORT_T, spec_hash,
            device.name, device.capability, device.sm_count, where)
    found = _RESOLVED.get(memo, _MISSING)
    if found is not _MISSING:
        return dict(found) if found else None
    base = cache_dir(directory)
    found = None
    wanted = spec_hash or spec_hash_for(spec_name)
    if wanted is not None:
        ident = (spec_name, stage, str(HV), str(K), str(V), dtype_name(dtype), str(BT),
                 par_bucket(N * HV, device.sm_count))
        for path, shipped in ((base / f"{device.slug}.json", False), (shipped_path(device), True)):
            table = _table(path, device, shipped)
            if table is None:
                continue
            for _, _, key, entry in table.find(ident, H, T):
                if _usable(table, key, entry, spec_name=spec_name, stage=stage, spec_hash=wanted,
                           K=K, V=V, BT=BT, dtype=dtype):
                    found = dict(entry["config"])
                    break
            if found is not None:
                break
    _RESOLVED[memo] = found
    return dict(found) if found else None


def chunk_size_hint(spec_name: str, *, K: int, V: int, N: int, HV: int, dtype, H: Optional[int] = None,
                    T: Optional[int] = None, device: Optional[DeviceInfo] = None,
                    directory: Optional[str | os.PathLike] = None, training: bool = False) -> Optional[int]:
    """The chunk size the tuner found fastest for this shape class (None when not tuned).

    The generated functions take ``chunk_size`` from the caller; this is advice for the caller.
    ``training=True``: the fastest forward + backward (tuned with backward stages), else forward."""
    found = lookup(spec_name, "chunk_train" if training else "chunk", K=K, V=V, BT=0, N=N, HV=HV, dtype=dtype,
                   H=H, T=T, device=device, directory=directory)
    return found["chunk_size"] if found else None


def segments_hint(spec_name: str, *, K: int, V: int, BT: int, N: int, HV: int, dtype, H: Optional[int] = None,
                  T: Optional[int] = None, device: Optional[DeviceInfo] = None,
                  directory: Optional[str | os.PathLike] = None) -> Optional[int]:
    """Segments per sequence the tuner found fastest for the intra-card split (``gdngen tune --stages
    split``) of this shape class and chunk size; None when not tuned (or without a GPU)."""
    found = lookup(spec_name, SPLIT_STAGE, K=K, V=V, BT=BT, N=N, HV=HV, dtype=dtype, H=H, T=T, device=device,
                   directory=directory)
    return found["segments"] if found else None


# ---- writing -------------------------------------------------------------------------------

def write_entries(device: DeviceInfo, entries: dict[str, dict], *,
                  directory: Optional[str | os.PathLike] = None, path: Optional[Path] = None) -> Path:
    """Merge ``entries`` into the device's cache file (atomically) and forget memoised lookups."""
    path = Path(path) if path is not None else user_cache_path(device, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = _read(path) if path.exists() else None
    if doc is None or doc["device"] != device.name or tuple(doc["capability"]) != tuple(device.capability):
        doc = {"format": FORMAT, "device": device.name, "capability": list(device.capability), "entries": {}}
    doc["entries"].update(entries)
    doc["entries"] = dict(sorted(doc["entries"].items()))
    problem = validate_document(doc)
    if problem:
        raise ValueError(f"entries: refusing to write a malformed cache ({problem})")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    _TABLES.pop(str(path), None)
    _forget_resolved()
    return path


def make_entry(config: dict, *, spec_hash: str, **extra) -> dict:
    entry = {"config": dict(config), "spec_hash": spec_hash, "triton": _triton_version()}
    entry.update(extra)
    return entry


__all__ = ["ADVICE_STAGES", "RECURRENT_STAGE", "SPLIT_STAGE", "CacheWarning", "FORMAT", "SHORT_T", "cache_dir", "chunk_size_hint", "clear_memo",
           "dependent_memo", "entry_key", "lookup_context", "lookup", "make_entry", "par_bucket", "segments_hint", "shape_class", "shipped_path", "spec_hash_for", "t_bucket",
           "user_cache_path", "write_entries", "STAGES"]
