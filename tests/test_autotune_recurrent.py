"""The tuner's decode stage (issue #5: decode in the tuned caches): fused_recurrent_* V tile and warps,
each candidate checked against the default before it is timed, the winner read by recurrent_tiles."""
import json

import pytest
import torch

from gdngen.autotune import cache
from gdngen.autotune.device import DeviceInfo
from gdngen.autotune.tuner import ShapeCase, format_recurrent_rows, tune_recurrent
from gdngen.runtime import recurrent

H200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)
CASE = ShapeCase(2, 1, 1, 2, 16, 32, torch.float32)


@pytest.fixture(scope="module")
def gdn():
    import generated.gated_delta_rule as module
    return module


def _timer(prefer):
    def timer(fn, cand):
        fn()
        return 1.0 if cand.config == prefer else 2.0
    return timer


def test_fastest_right_config_wins_and_is_cached(gdn, isolated_cache):
    rows = tune_recurrent(gdn.SPEC, [CASE], device=H200, timer=_timer({"BV": 8, "num_warps": 2}))
    assert rows[0]["default"] and all("ms" in r for r in rows)
    assert [r["config"] for r in rows if r["winner"]] == [{"BV": 8, "num_warps": 2}]
    doc = json.loads((isolated_cache / "cache" / "nvidia-h200-sm90.json").read_text())
    (key, entry), = doc["entries"].items()
    assert key.startswith("gated_delta_rule/recurrent/") and "dtype=float32,BT=0" in key
    assert entry["config"] == {"BV": 8, "num_warps": 2}
    assert "winner" in format_recurrent_rows(rows)
    # recurrent_tiles serves it on a GPU of that name (the lookup itself is device-keyed)
    with cache_device(H200):
        found = cache.lookup("gated_delta_rule", "recurrent", K=16, V=32, BT=0, N=2, HV=2, dtype=torch.float32)
    assert found == {"BV": 8, "num_warps": 2}


def test_a_wrong_config_is_never_chosen(gdn, isolated_cache, monkeypatch):
    real = gdn.fused_recurrent_gated_delta_rule

    def broken(*args, **kwargs):
        o, final = real(*args, **kwargs)
        config = recurrent.recurrent_tiles("gated_delta_rule", N=2, HV=2, K=16, V=32, state_dtype=torch.float32,
                                           device=torch.device("cpu"))
        return (o + 1.0, final) if config["num_warps"] == 4 else (o, final)

    monkeypatch.setattr(gdn, "fused_recurrent_gated_delta_rule", broken)
    rows = tune_recurrent(gdn.SPEC, [CASE], device=H200, timer=_timer({"BV": 32, "num_warps": 4}), write=False)
    bad = [r for r in rows if r["config"]["num_warps"] == 4]
    assert bad and all("rejected" in r and not r["winner"] for r in bad)
    assert [r["config"] for r in rows if r["winner"]] == [rows[0]["config"]]      # nothing else was faster


def test_invalid_cached_recurrent_entries_are_ignored(gdn, isolated_cache):
    tune_recurrent(gdn.SPEC, [CASE], device=H200, timer=_timer({"BV": 8, "num_warps": 2}), max_candidates=4)
    path = isolated_cache / "cache" / "nvidia-h200-sm90.json"
    doc = json.loads(path.read_text())
    for entry in doc["entries"].values():
        entry["config"] = {"BV": 12, "num_warps": 2}          # not a power of two
    path.write_text(json.dumps(doc))
    cache.clear_memo()
    with pytest.warns(cache.CacheWarning), cache_device(H200):
        assert cache.lookup("gated_delta_rule", "recurrent", K=16, V=32, BT=0, N=2, HV=2, dtype=torch.float32) is None


def test_cli_recurrent_stage_dry_run(isolated_cache, capsys):
    from gdngen.cli import main
    rc = main(["tune", "gated_delta_rule", "--interpret", "--shapes", "2,1,1,2,16,32", "--stages", "recurrent",
               "--max-candidates", "3", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "warps" in out and "default" in out


def cache_device(info):
    from gdngen.autotune.device import use_device
    return use_device(info)
