"""Load a YAML spec into a frozen, validated :class:`Spec`.

Every error raised here is a :class:`SpecError` (a ``ValueError``) whose message names the spec
file, the dotted key and what was expected, so a researcher writing a new variant sees at once
which line to fix.  The schema is documented key by key in ``specs/README.md``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any

import yaml

DECAYS = ("none", "scalar", "vector")
DECAY_PARAMS = ("given", "fused")      # log-decay passed in, or -exp(A_log)*softplus(g + dt_bias)
BETA_PARAMS = ("given", "sigmoid")     # beta passed in, or sigmoid(logits) (2*sigmoid with neg eigvals)
DTYPES = ("float32", "float16", "bfloat16")
FEATURE_MAPS = ("identity", "elu+1", "relu", "random_features")
# Other spellings a call may use for a feature map (FLA and Katharopoulos et al. call elu+1 "elu").
FEATURE_MAP_ALIASES = {"elu": "elu+1"}
CHUNK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 256


class SpecError(ValueError):
    """A spec file is invalid; the message names the file and the key."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key = source, key
        super().__init__(f"{source}: key '{key}': {message}")


@dataclass(frozen=True)
class Transition:
    decay: str                 # none | scalar (per head) | vector (per key channel)
    delta: bool                # delta rule: S <- (I - beta k k^T) S + beta k v^T
    allow_neg_eigval: bool     # beta may reach 2 (eigenvalues of I - beta k k^T in [-1, 1])


@dataclass(frozen=True)
class Gates:
    decay: tuple[str, ...]     # accepted log-decay parameterisations, subset of DECAY_PARAMS
    beta: tuple[str, ...]      # accepted beta parameterisations, subset of BETA_PARAMS


@dataclass(frozen=True)
class Heads:
    max_k: int
    max_v: int
    gva: bool                  # grouped value heads: HV a multiple of H


@dataclass(frozen=True)
class Chunk:
    sizes: tuple[int, ...]
    default: int


@dataclass(frozen=True)
class DTypes:
    inputs: tuple[str, ...]
    state: str                 # dtype of initial/final states
    accumulate: str            # dtype of in-kernel accumulation
    chunk_states: str          # dtype of the chunk-boundary states kept between stages
    # the forward's W, U, T and V_new buffers: "input" (16-bit for 16-bit inputs), "float32" (more
    # precise, more memory), or "split" (16-bit buffers; the output stage recomputes V_new in float32
    # and its float32 products run as bf16 hi + lo pairs: delta rule with scalar or no decay)
    intermediates: str = "input"


@dataclass(frozen=True)
class Spec:
    name: str
    description: str
    transition: Transition
    gates: Gates
    qk_l2norm: bool
    feature_maps: tuple[str, ...]
    normalize: bool
    heads: Heads
    chunk: Chunk
    dtypes: DTypes
    source: str = field(default="<memory>", compare=False)

    # -- derived facts the rest of the pipeline asks for ------------------------------------
    @property
    def family(self) -> str:
        return "delta" if self.transition.delta else "additive"

    @property
    def has_decay(self) -> bool:
        return self.transition.decay != "none"

    @property
    def has_beta(self) -> bool:
        return self.transition.delta

    @property
    def chunk_function(self) -> str:
        return f"chunk_{self.name}"

    @property
    def recurrent_function(self) -> str:
        return f"fused_recurrent_{self.name}"

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-like data (lists, not tuples): spec_from_dict(spec.to_dict()) == spec."""
        d = asdict(self)
        d.pop("source")
        return json.loads(json.dumps(d))

    @property
    def hash(self) -> str:
        """Content hash of the validated spec (independent of file layout and comments)."""
        d = self.to_dict()
        if d["dtypes"]["intermediates"] == "input":
            del d["dtypes"]["intermediates"]     # added later at this default: earlier hashes stay valid
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Schema: key -> (expected description, default or REQUIRED)
REQUIRED = object()
_SCHEMA: dict[str, Any] = {
    "name": REQUIRED,
    "description": "",
    "transition": {"decay": REQUIRED, "delta": REQUIRED, "allow_neg_eigval": False},
    "gates": {"decay": ["given"], "beta": ["given"]},
    "qk_l2norm": False,
    "feature_maps": ["identity"],
    "normalize": False,
    "heads": {"max_k": MAX_HEAD_DIM, "max_v": MAX_HEAD_DIM, "gva": True},
    "chunk": {"sizes": [16, 32, 64], "default": 64},
    "dtypes": {
        "inputs": ["float32", "float16", "bfloat16"],
        "state": "float32",
        "accumulate": "float32",
        "chunk_states": "input",
        "intermediates": "input",
    },
}


class _Reader:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, message: str):
        raise SpecError(self.source, key, message)

    def merge(self, raw: Any, schema: dict, prefix: str) -> dict:
        if not isinstance(raw, dict):
            self.fail(prefix.rstrip(".") or "<root>", f"expected a mapping, got {type(raw).__name__}")
        for key in raw:
            if key not in schema:
                known = ", ".join(sorted(schema))
                self.fail(f"{prefix}{key}", f"unknown key; expected one of: {known}")
        out = {}
        for key, default in schema.items():
            dotted = f"{prefix}{key}"
            if isinstance(default, dict):
                out[key] = self.merge(raw.get(key, {}), default, dotted + ".")
            elif key in raw:
                out[key] = raw[key]
            elif default is REQUIRED:
                self.fail(dotted, "required key is missing")
            else:
                out[key] = default
        return out

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {value!r}")
        return value

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {value!r}")
        return value

    def choice(self, value: Any, key: str, choices: tuple) -> str:
        if value not in choices:
            self.fail(key, f"expected one of {list(choices)}, got {value!r}")
        return value

    def choices(self, value: Any, key: str, choices: tuple) -> tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            self.fail(key, f"expected a non-empty list drawn from {list(choices)}, got {value!r}")
        for item in value:
            self.choice(item, key, choices)
        if len(set(value)) != len(value):
            self.fail(key, f"duplicate entries in {value!r}")
        return tuple(value)

    def integer(self, value: Any, key: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {value!r}")
        if not lo <= value <= hi:
            self.fail(key, f"expected an integer in [{lo}, {hi}], got {value}")
        return value


def spec_from_dict(raw: Any, source: str = "<memory>") -> Spec:
    """Validate a parsed YAML mapping and build a frozen :class:`Spec`."""
    r = _Reader(source)
    d = r.merge(raw, _SCHEMA, "")

    name = r.string(d["name"], "name")
    if not name.isidentifier() or name != name.lower():
        r.fail("name", f"expected a lower-case Python identifier, got {name!r}")
    description = r.string(d["description"], "description")

    t = d["transition"]
    transition = Transition(
        decay=r.choice(t["decay"], "transition.decay", DECAYS),
        delta=r.boolean(t["delta"], "transition.delta"),
        allow_neg_eigval=r.boolean(t["allow_neg_eigval"], "transition.allow_neg_eigval"),
    )
    if transition.allow_neg_eigval and not transition.delta:
        r.fail("transition.allow_neg_eigval",
               "negative eigenvalues need the delta rule (transition.delta: true)")

    g = d["gates"]
    gates = Gates(decay=r.choices(g["decay"], "gates.decay", DECAY_PARAMS),
                  beta=r.choices(g["beta"], "gates.beta", BETA_PARAMS))
    if transition.decay != "scalar" and "fused" in gates.decay:
        r.fail("gates.decay", "the fused gate -exp(A_log)*softplus(g + dt_bias) is defined for "
               "transition.decay: scalar only; expected [given]")
    if transition.decay == "none" and gates.decay != ("given",):
        r.fail("gates.decay", "transition.decay is none, so there is no log-decay to parameterise")
    if not transition.delta and gates.beta != ("given",):
        r.fail("gates.beta", "beta exists only with the delta rule (transition.delta: true)")
    if transition.allow_neg_eigval and "sigmoid" not in gates.beta:
        r.fail("transition.allow_neg_eigval",
               "allow_neg_eigval scales a sigmoid beta by 2; add 'sigmoid' to gates.beta")

    qk_l2norm = r.boolean(d["qk_l2norm"], "qk_l2norm")
    feature_maps = r.choices(d["feature_maps"], "feature_maps", FEATURE_MAPS)
    if feature_maps != ("identity",) and transition.delta:
        r.fail("feature_maps", "feature maps are for the additive family; the delta rule needs "
               "normalised keys (use qk_l2norm)")
    normalize = r.boolean(d["normalize"], "normalize")
    if normalize and (transition.delta or transition.decay != "none"):
        r.fail("normalize", "the q·Σk normaliser is defined for plain linear attention "
               "(transition.decay: none, delta: false)")

    h = d["heads"]
    heads = Heads(max_k=r.integer(h["max_k"], "heads.max_k", 1, MAX_HEAD_DIM),
                  max_v=r.integer(h["max_v"], "heads.max_v", 1, MAX_HEAD_DIM),
                  gva=r.boolean(h["gva"], "heads.gva"))

    c = d["chunk"]
    sizes = c["sizes"]
    if not isinstance(sizes, list) or not sizes:
        r.fail("chunk.sizes", f"expected a non-empty list drawn from {list(CHUNK_SIZES)}, got {sizes!r}")
    sizes = tuple(sorted(set(r.choice(r.integer(s, "chunk.sizes", 1, max(CHUNK_SIZES)), "chunk.sizes",
                                      CHUNK_SIZES) for s in sizes)))
    default = r.integer(c["default"], "chunk.default", 1, max(CHUNK_SIZES))
    if default not in sizes:
        r.fail("chunk.default", f"expected one of chunk.sizes {list(sizes)}, got {default!r}")
    chunk = Chunk(sizes=sizes, default=default)

    dt = d["dtypes"]
    dtypes = DTypes(inputs=r.choices(dt["inputs"], "dtypes.inputs", DTYPES),
                    state=r.choice(dt["state"], "dtypes.state", ("float32",)),
                    accumulate=r.choice(dt["accumulate"], "dtypes.accumulate", ("float32",)),
                    chunk_states=r.choice(dt["chunk_states"], "dtypes.chunk_states",
                                          ("float32", "input")),
                    intermediates=r.choice(dt["intermediates"], "dtypes.intermediates", ("float16", "float32", "input", "split")))
    # the precision policies the scalar- and no-decay delta rule's kernels implement
    needs_delta = {"split": "recomputes the delta rule's V_new in the output stage",
                   "float16": "rounds the delta rule's T, X, V_new and scores to float16"}
    if dtypes.intermediates in needs_delta and not (transition.delta and transition.decay in ("scalar", "none")):
        r.fail("dtypes.intermediates", f"{dtypes.intermediates!r} {needs_delta[dtypes.intermediates]}: it needs "
               f"transition.delta true and a scalar or no decay, got delta {transition.delta}, decay {transition.decay!r}")

    return Spec(name=name, description=description, transition=transition, gates=gates,
                qk_l2norm=qk_l2norm, feature_maps=feature_maps, normalize=normalize, heads=heads,
                chunk=chunk, dtypes=dtypes, source=source)


def load_spec(path: str | Path) -> Spec:
    """Read and validate one YAML spec file."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(source, "<file>", f"cannot read the spec: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(source, "<yaml>", f"not valid YAML: {exc}") from None
    spec = spec_from_dict(raw, source)
    if path.stem != spec.name:
        raise SpecError(source, "name", f"expected the file stem {path.stem!r}, got {spec.name!r}")
    return spec


SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"


def catalogue() -> list[Path]:
    """The bundled spec files, in name order."""
    return sorted(SPECS_DIR.glob("*.yaml"))
