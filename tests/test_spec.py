"""The spec loader: the catalogue loads, Spec is frozen and hashable, and every invalid spec is
rejected with a SpecError that names the file and the dotted key."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from gdngen.spec import Spec, SpecError, catalogue, load_spec, spec_from_dict

CATALOGUE = ["delta_rule", "gated_delta_rule", "gla", "kda", "linear_attn", "simple_gla"]

MINIMAL = {"name": "x", "transition": {"decay": "scalar", "delta": True}}


def _write(tmp_path: Path, data, name: str = "x") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _with(base: dict, dotted: str, value) -> dict:
    """A deep copy of ``base`` with ``dotted`` set to ``value``."""
    data = yaml.safe_load(yaml.safe_dump(base))
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return data


def _without(base: dict, dotted: str) -> dict:
    data = yaml.safe_load(yaml.safe_dump(base))
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node[p]
    del node[last]
    return data


def _rejects(tmp_path: Path, data, key: str, name: str = "x", match: str | None = None) -> SpecError:
    """Load ``data`` from a file and check the SpecError names the file and ``key``."""
    path = _write(tmp_path, data, name)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    exc = info.value
    message = str(exc)
    assert str(path) in message, message
    assert f"'{key}'" in message, message
    assert exc.key == key and exc.source == str(path)
    if match is not None:
        assert match in message, message
    return exc


# -- the catalogue --------------------------------------------------------------------------

def test_catalogue_lists_every_bundled_spec():
    assert [p.stem for p in catalogue()] == CATALOGUE


@pytest.mark.parametrize("path", catalogue(), ids=lambda p: p.stem)
def test_catalogue_spec_loads(path):
    spec = load_spec(path)
    assert isinstance(spec, Spec)
    assert spec.name == path.stem
    assert spec.chunk.default in spec.chunk.sizes
    assert spec.chunk_function == f"chunk_{spec.name}"


def test_catalogue_facts():
    specs = {p.stem: load_spec(p) for p in catalogue()}
    gdr = specs["gated_delta_rule"]
    assert (gdr.transition.decay, gdr.transition.delta, gdr.transition.allow_neg_eigval) == ("scalar", True, True)
    assert gdr.gates.decay == ("given", "fused") and gdr.gates.beta == ("given", "sigmoid")
    assert gdr.qk_l2norm and gdr.family == "delta" and gdr.has_decay and gdr.has_beta
    assert specs["delta_rule"].transition.decay == "none" and not specs["delta_rule"].has_decay
    assert specs["gla"].transition.decay == "vector" and specs["gla"].family == "additive"
    assert specs["kda"].transition.decay == "vector" and specs["kda"].transition.delta and specs["kda"].has_beta
    assert specs["linear_attn"].normalize and len(specs["linear_attn"].feature_maps) == 4
    assert specs["simple_gla"].transition.decay == "scalar" and not specs["simple_gla"].has_beta


def test_defaults_fill_optional_keys():
    spec = spec_from_dict(MINIMAL)
    assert spec.description == ""
    assert spec.transition.allow_neg_eigval is False
    assert spec.gates.decay == ("given",) and spec.gates.beta == ("given",)
    assert spec.qk_l2norm is False and spec.feature_maps == ("identity",) and spec.normalize is False
    assert (spec.heads.max_k, spec.heads.max_v, spec.heads.gva) == (256, 256, True)
    assert spec.chunk.sizes == (16, 32, 64) and spec.chunk.default == 64
    assert spec.dtypes.inputs == ("float32", "float16", "bfloat16")
    assert spec.dtypes.state == spec.dtypes.accumulate == "float32"
    assert spec.dtypes.chunk_states == "input"


def test_single_string_accepted_for_list_keys():
    spec = spec_from_dict(_with(MINIMAL, "gates.beta", "sigmoid"))
    assert spec.gates.beta == ("sigmoid",)


def test_chunk_sizes_sorted_and_deduplicated():
    spec = spec_from_dict(_with(MINIMAL, "chunk", {"sizes": [64, 16, 64], "default": 16}))
    assert spec.chunk.sizes == (16, 64)


# -- frozen, round trip, hash ---------------------------------------------------------------

def test_spec_is_frozen():
    spec = load_spec(catalogue()[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.transition.delta = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.chunk.default = 16
    assert isinstance(spec.chunk.sizes, tuple) and isinstance(spec.gates.decay, tuple)
    hash(spec)      # usable as a cache key (build_plan is lru_cached on it)


@pytest.mark.parametrize("path", catalogue(), ids=lambda p: p.stem)
def test_to_dict_round_trips(path):
    spec = load_spec(path)
    data = spec.to_dict()
    assert "source" not in data
    again = spec_from_dict(data, source="elsewhere.yaml")
    assert again == spec
    assert again.hash == spec.hash
    assert hash(again) == hash(spec)
    # to_dict is plain YAML data: it survives a YAML dump/load unchanged.
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_hash_ignores_file_layout_and_comments(tmp_path):
    path = _write(tmp_path, "# a comment\nname: x\ntransition: {delta: true, decay: scalar}\n")
    assert load_spec(path).hash == spec_from_dict(MINIMAL).hash


@pytest.mark.parametrize("key, value", [
    ("description", "something else"),
    ("transition.allow_neg_eigval", True),
    ("gates.decay", ["given", "fused"]),
    ("qk_l2norm", True),
    ("heads.max_k", 128),
    ("heads.gva", False),
    ("chunk.default", 32),
    ("dtypes.inputs", ["float32"]),
    ("dtypes.chunk_states", "float32"),
])
def test_hash_changes_when_a_key_changes(key, value):
    base = _with(MINIMAL, "gates.beta", ["given", "sigmoid"])
    changed = _with(base, key, value)
    assert spec_from_dict(changed).hash != spec_from_dict(base).hash
    assert spec_from_dict(changed) != spec_from_dict(base)


def test_spec_error_is_value_error():
    assert issubclass(SpecError, ValueError)
    with pytest.raises(ValueError):
        spec_from_dict({"name": "x"})


# -- unknown keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["transitions", "transition.dekay", "heads.max_q", "dtypes.output"])
def test_unknown_key(tmp_path, key):
    _rejects(tmp_path, _with(MINIMAL, key, 1), key, match="unknown key")


# -- wrong types ----------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("transition.delta", "yes"),
    ("transition.allow_neg_eigval", 1),
    ("qk_l2norm", "true"),
    ("heads.max_k", "big"),
    ("heads.max_v", 64.0),
    ("heads.gva", None),
    ("chunk.sizes", 64),
    ("gates.beta", []),
    ("name", 3),
    ("description", ["a"]),
])
def test_wrong_type(tmp_path, key, value):
    _rejects(tmp_path, _with(MINIMAL, key, value), key)


@pytest.mark.parametrize("text", ["name: x\ntransition: scalar\n", "name: x\ntransition:\n"])
def test_nested_block_not_a_mapping(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(SpecError, match="expected a mapping") as info:
        load_spec(path)
    # Today the key is reported with a trailing dot ('transition.'); 'transition' would be cleaner.
    assert info.value.key.rstrip(".") == "transition" and str(path) in str(info.value)


def test_root_must_be_a_mapping(tmp_path):
    _rejects(tmp_path, "- just\n- a list\n", "<root>", match="expected a mapping")


def test_empty_file(tmp_path):
    _rejects(tmp_path, "", "<root>")


# -- out-of-range values --------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("heads.max_k", 512),
    ("heads.max_k", 0),
    ("heads.max_v", 257),
    ("chunk.sizes", [48]),
    ("chunk.sizes", [16, 256]),
    ("transition.decay", "matrix"),
    ("gates.decay", ["learned"]),
    ("feature_maps", ["softmax"]),
    ("dtypes.inputs", ["float64"]),
    ("dtypes.state", "bfloat16"),
    ("dtypes.accumulate", "float16"),
    ("dtypes.chunk_states", "float16"),
    ("name", "GatedDelta"),
    ("name", "not-an-identifier"),
])
def test_out_of_range(tmp_path, key, value):
    _rejects(tmp_path, _with(MINIMAL, key, value), key)


def test_duplicate_list_entries(tmp_path):
    _rejects(tmp_path, _with(MINIMAL, "gates.beta", ["sigmoid", "sigmoid"]), "gates.beta", match="duplicate")


# -- missing required keys ------------------------------------------------------------------

@pytest.mark.parametrize("key", ["name", "transition.decay", "transition.delta"])
def test_missing_required_key(tmp_path, key):
    _rejects(tmp_path, _without(MINIMAL, key), key, match="required key is missing")


def test_missing_transition_block(tmp_path):
    _rejects(tmp_path, {"name": "x"}, "transition.decay", match="required")


# -- contradictory options ------------------------------------------------------------------

@pytest.mark.parametrize("changes, key", [
    ({"transition.delta": False, "transition.allow_neg_eigval": True}, "transition.allow_neg_eigval"),
    ({"transition.allow_neg_eigval": True}, "transition.allow_neg_eigval"),        # no sigmoid beta
    ({"transition.delta": False, "gates.beta": ["given", "sigmoid"]}, "gates.beta"),
    ({"transition.decay": "vector", "gates.decay": ["given", "fused"]}, "gates.decay"),
    ({"transition.decay": "none", "gates.decay": ["fused"]}, "gates.decay"),
    ({"transition.decay": "none", "normalize": True}, "normalize"),                # delta: true
    ({"transition.delta": False, "normalize": True}, "normalize"),                 # decay: scalar
    ({"feature_maps": ["elu+1"]}, "feature_maps"),                                 # delta: true
    ({"chunk.default": 128}, "chunk.default"),
    ({"chunk.sizes": [16, 32], "chunk.default": 64}, "chunk.default"),
])
def test_contradictory_options(tmp_path, changes, key):
    data = MINIMAL
    for k, v in changes.items():
        data = _with(data, k, v)
    _rejects(tmp_path, data, key)


def test_file_stem_must_match_name(tmp_path):
    _rejects(tmp_path, _with(MINIMAL, "name", "other"), "name", name="x", match="file stem")


# -- unreadable file, invalid YAML -----------------------------------------------------------

def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and "'<file>'" in str(info.value)


def test_directory_is_unreadable(tmp_path):
    path = tmp_path / "x.yaml"
    path.mkdir()
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and "'<file>'" in str(info.value)


def test_invalid_yaml(tmp_path):
    _rejects(tmp_path, "name: x\ntransition: {decay: scalar, delta: true\n", "<yaml>", match="not valid YAML")


@pytest.mark.parametrize("policy", ["split", "float16"])
@pytest.mark.parametrize("transition", [{"decay": "vector", "delta": True}, {"decay": "scalar", "delta": False}])
def test_precise_intermediates_need_the_delta_rule_with_scalar_or_no_decay(tmp_path, transition, policy):
    """dtypes.intermediates: split recomputes V_new in the output stage, float16 rounds T, X, V_new and
    the scores to float16: a per-channel decay or an additive spec (no V_new) is refused by key; the
    delta rule with scalar or no decay is taken."""
    data = _with(_with(MINIMAL, "transition", transition), "dtypes.intermediates", policy)
    _rejects(tmp_path, data, "dtypes.intermediates", match="scalar or no decay")
    for decay in ("scalar", "none"):
        ok = _with(_with(MINIMAL, "transition", {"decay": decay, "delta": True}), "dtypes.intermediates", policy)
        assert load_spec(_write(tmp_path, ok)).dtypes.intermediates == policy
