"""``gdngen bench``'s FLA peer for every catalogue spec (issue #7), on CPU without FLA.

A fake ``fla`` package is injected into ``sys.modules``; each adapter row of ``bench.FLA_PEERS`` must call
FLA's op of the spec's name with make_inputs' tensors in FLA's parameter order.  Where FLA 0.6.0's wheel
is at ``.anchors/`` the adapter's argument names are also checked against the real signatures.
"""
import ast
import inspect
import sys
import types
import zipfile

import pytest
import torch

from gdngen import bench
from gdngen.render import ROOT
from gdngen.spec import load_spec

SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
EXPECTED = {                      # spec -> (FLA module, function, positional inputs, fixed kwargs)
    "linear_attn": ("fla.ops.linear_attn", "chunk_linear_attn", ("q", "k", "v"), {"normalize": True}),
    "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla", ("q", "k", "v", "g"), {}),
    "gla": ("fla.ops.gla", "chunk_gla", ("q", "k", "v", "g"), {}),
    "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule", ("q", "k", "v", "beta"), {}),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", ("q", "k", "v", "g", "beta"), {}),
    "kda": ("fla.ops.kda", "chunk_kda", ("q", "k", "v", "g", "beta"), {}),
}
WHEEL = ROOT / ".anchors" / "fla_core-0.6.0-py3-none-any.whl"


@pytest.fixture
def fake_fla(monkeypatch):
    """A fake ``fla`` package whose ops record (function name, args, kwargs) and return (v * 2, None)."""
    calls = []
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    for module, function, _, _ in EXPECTED.values():
        mod = types.ModuleType(module)

        def op(*args, _name=function, **kwargs):
            calls.append((_name, args, kwargs))
            return args[2] * 2, None

        setattr(mod, function, op)
        monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    return calls


def fake_module(spec):
    return types.SimpleNamespace(**{spec.chunk_function: lambda **inputs: (inputs["v"], None)})


def test_every_catalogue_spec_has_an_fla_peer():
    assert set(SPECS) == set(EXPECTED) == set(bench.FLA_PEERS)


@pytest.mark.parametrize("name", SPECS)
def test_fla_adapter_passes_make_inputs_in_fla_order(name, fake_fla):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    module, function, positional, kwargs = EXPECTED[name]
    logged = []
    impls = bench.load_impls(["gdngen", "fla"], spec, fake_module(spec), "cpu", log=logged.append)
    assert set(impls) == {"gdngen", "fla"} and logged == []
    inputs = bench.make_inputs(spec, bench.Case("c", 1, 8, 2, 2, 4, 4), torch.float32, "cpu")
    # the adapter forwards every input gdngen gets, none dropped, none converted
    assert set(positional) == set(inputs)
    o = impls["fla"](inputs)
    assert torch.equal(o, inputs["v"] * 2)
    ((called, args, got_kwargs),) = fake_fla
    assert called == function
    assert len(args) == len(positional) and all(a is inputs[n] for a, n in zip(args, positional))
    assert got_kwargs == kwargs
    assert (spec.chunk_function == function)              # FLA's op of the same name
    if name == "gated_delta_rule":
        import os
        assert os.environ["FLA_FLASH_QLA"] == "0"        # FLA's own Triton path, FlashQLA is its own row


@pytest.mark.parametrize("name", SPECS)
def test_fla_adapter_rejects_gva_where_fla_does_not_take_it(name, fake_fla):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    if not spec.heads.gva:
        pytest.skip(f"{name}: no grouped value heads in the spec")
    fla = bench.load_impls(["fla"], spec, fake_module(spec), "cpu", log=lambda m: None)["fla"]
    inputs = bench.make_inputs(spec, bench.Case("c", 1, 8, 1, 2, 4, 4), torch.float32, "cpu")
    if bench.FLA_PEERS[name].gva:
        fla(inputs)
        assert fake_fla
    else:
        with pytest.raises(ValueError, match="takes H == HV only"):
            fla(inputs)
        assert not fake_fla


def test_gdn_only_peers_are_logged_and_skipped_for_other_specs(fake_fla):
    spec = load_spec(ROOT / "specs" / "kda.yaml")
    logged = []
    impls = bench.load_impls(["gdngen", "fla", "flashqla", "sdpa"], spec, fake_module(spec), "cpu", log=logged.append)
    assert set(impls) == {"gdngen", "fla"}
    assert logged == ["peers ['flashqla', 'sdpa'] skipped: they implement gated_delta_rule, not kda"]


@pytest.mark.parametrize("name", SPECS)
def test_missing_fla_is_logged_not_fatal(name, monkeypatch):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    monkeypatch.setitem(sys.modules, "fla", None)                  # import fla raises ImportError
    logged = []
    impls = bench.load_impls(["gdngen", "fla"], spec, fake_module(spec), "cpu", log=logged.append)
    assert set(impls) == {"gdngen"}
    assert len(logged) == 1 and logged[0].startswith("fla unavailable:")


def test_linear_attn_normalize_matches_gdngen_default():
    """Both ops default to normalize=True; the adapter pins FLA's to what gdngen's op does when called plainly."""
    from generated.linear_attn import chunk_linear_attn
    default = inspect.signature(chunk_linear_attn).parameters["normalize"].default
    assert dict(bench.FLA_PEERS["linear_attn"].kwargs)["normalize"] is default


def test_cli_bench_with_fla_missing_still_times_gdngen(tmp_path, monkeypatch, capsys):
    """``gdngen bench <spec> --impls gdngen,fla`` with FLA absent: the peer is logged, gdngen is timed."""
    import json
    from gdngen.cli import main
    monkeypatch.setitem(sys.modules, "fla", None)
    out = tmp_path / "kda.json"
    assert main(["bench", "kda", "--skip-check", "--impls", "gdngen,fla", "--modes", "fwd",
                 "--cases", "1,32,1,1,16,16", "--out", str(out)]) == 0
    assert "fla unavailable" in capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert [(r["impl"], r["op"]) for r in rows] == [("gdngen", "chunk_kda")] and rows[0]["ms"] > 0


def _wheel_signature(module: str, function: str):
    """(positional parameter names, all parameter names) of ``function`` in the wheel's ``<module>/chunk.py``."""
    with zipfile.ZipFile(WHEEL) as wheel:
        tree = ast.parse(wheel.read(module.replace(".", "/") + "/chunk.py"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    positional = [a.arg for a in fn.args.args]
    return positional, positional + [a.arg for a in fn.args.kwonlyargs]


@pytest.mark.skipif(not WHEEL.exists(), reason="FLA 0.6.0 wheel not at .anchors/")
@pytest.mark.parametrize("name", SPECS)
def test_adapter_matches_fla_060_signatures(name):
    peer = bench.FLA_PEERS[name]
    positional, everything = _wheel_signature(peer.module, peer.function)
    assert tuple(positional[:len(peer.args)]) == peer.args
    assert all(key in everything for key, _ in peer.kwargs)
