"""Autotuner machinery on CPU: search space, per-device cache, lookup chain, tuner (fake timers)."""
import json
import warnings

import pytest
import torch

from gdngen.autotune import cache, space
from gdngen.autotune.device import DeviceInfo, use_device
from gdngen.autotune.tuner import INTERPRETER_DEVICE, ShapeCase, check_outputs, format_report, tune
from gdngen.runtime import override, tiles
from gdngen.runtime.tiles import default_tiles
from gdngen.selfcheck import call, make_inputs, reference_outputs, rel_rmse

H200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), sm_count=132)
BF16 = torch.bfloat16
SHAPE = dict(K=128, V=128, BT=64, N=4, HV=32, dtype=BF16)
SPEC = "gated_delta_rule"


pytestmark = pytest.mark.usefixtures("isolated_cache")    # conftest: an empty cache per test


@pytest.fixture(scope="module")
def gdn():
    import generated.gated_delta_rule as module
    return module


def spec_hash():
    return cache.spec_hash_for(SPEC)


def entry(config, **kw):
    kw.setdefault("spec_hash", spec_hash())
    return cache.make_entry(config, **kw)


def key(stage, H=16, T=8192, **over):
    shape = dict(SHAPE, **over)
    return cache.entry_key(SPEC, stage, cache.shape_class(H=H, HV=shape["HV"], K=shape["K"], V=shape["V"],
                                                          dtype=shape["dtype"], BT=shape["BT"], N=shape["N"],
                                                          T=T, sm_count=132))


def state_cfg(bv=32, w=4, s=2):
    return {"BK": 128, "BV": bv, "num_warps": w, "num_stages": s}


# ---- search space --------------------------------------------------------------------------

def test_huge_state_tile_is_pruned():
    big = {"BK": 256, "BV": 256, "num_warps": 2, "num_stages": 1}
    assert "registers" in space.fits("state", big, BT=64, dtype=BF16, device=H200)
    pruned = []
    default = default_tiles("state", K=256, V=256, BT=64, N=4, HV=32, dtype=BF16)
    found = space.candidates("state", K=256, V=256, BT=64, dtype=BF16, default=default, device=H200, pruned=pruned)
    assert big not in found and any(c == big for c, _ in pruned)
    assert all(c["BK"] == 256 for c in found)            # the state keeps the whole K extent


def test_known_bad_configs_are_excluded():
    default = default_tiles("output", K=64, V=32, BT=64, N=4, HV=32, dtype=BF16)
    pruned = []
    found = space.candidates("output", K=64, V=32, BT=64, dtype=BF16, default=default, device=H200, pruned=pruned)
    assert not [c for c in found if c["BK"] == 64 and c["BV"] == 32]
    assert any(c["BK"] == 64 and c["BV"] == 32 and why.startswith("known bad") for c, why in pruned)
    state = space.candidates("state", K=64, V=32, BT=64, dtype=BF16, device=H200,
                             default=default_tiles("state", K=64, V=32, BT=64, N=4, HV=32, dtype=BF16))
    assert all(c["num_warps"] != 8 for c in state)


def test_state_pass_never_runs_one_pipeline_stage():
    """One stage gave illegal memory accesses on the H200 (forward and backward state passes): neither
    the defaults nor the tuner's candidates use it, at any head dim or dtype."""
    for dtype in (BF16, torch.float16, torch.float32):
        for K in (16, 64, 128, 256):
            for per_channel in (False, True):
                default = default_tiles("state", K=K, V=128, BT=64, N=1, HV=4, dtype=dtype, per_channel=per_channel)
                assert default["num_stages"] >= 2, (dtype, K, per_channel, default)
            found = space.candidates("state", K=K, V=128, BT=64, dtype=dtype, device=H200,
                                     default=default_tiles("state", K=K, V=128, BT=64, N=1, HV=4, dtype=dtype))
            assert all(c["num_stages"] >= 2 for c in found), (dtype, K)


@pytest.mark.parametrize("device", [H200, DeviceInfo("Some Future GPU", (13, 7), sm_count=40)])
@pytest.mark.parametrize("K,V,BT,dtype", [(128, 128, 64, BF16), (256, 256, 64, torch.float32), (64, 32, 16, BF16)])
def test_surviving_candidates_respect_the_limits(device, K, V, BT, dtype):
    limit = device.smem
    assert limit == (227 * 1024 if device is H200 else 48 * 1024)    # table, then the conservative fallback
    for stage in space.STAGES:
        default = default_tiles(stage, K=K, V=V, BT=BT, N=4, HV=32, dtype=dtype)
        found = space.candidates(stage, K=K, V=V, BT=BT, dtype=dtype, default=default, device=device)
        assert found[0] == default
        for c in found[1:]:
            assert space.regs_per_thread(stage, c, BT=BT) <= space.REG_LIMIT
            assert space.smem_bytes(stage, c, BT=BT, dtype=dtype) <= limit
            assert space.excluded(stage, c, {"K": K, "V": V, "BT": BT, "dtype": dtype}) is None
            assert space.is_valid(stage, c, K=K, V=V)
            assert c["num_warps"] in (2, 4, 8) and c["num_stages"] in (1, 2, 3, 4)
        assert len(space.candidates(stage, K=K, V=V, BT=BT, dtype=dtype, default=default, device=device,
                                    limit=3)) <= 3


# ---- cache keys ----------------------------------------------------------------------------

def test_shape_class_buckets_sequence_length_and_parallelism():
    base = dict(H=16, HV=32, K=128, V=128, dtype=BF16, BT=64, N=4, sm_count=132)
    assert cache.shape_class(T=5000, **base) == cache.shape_class(T=9000, **base)
    assert "T=long" in cache.shape_class(T=5000, **base)
    assert cache.shape_class(T=4096, **base) != cache.shape_class(T=4097, **base)
    other = [dict(base, HV=16), dict(base, K=64), dict(base, dtype=torch.float16), dict(base, BT=32),
             dict(base, H=8), dict(base, N=1)]
    for o in other:
        assert cache.shape_class(T=9000, **o) != cache.shape_class(T=9000, **base), o
    assert cache.par_bucket(16, 132) == "low" and cache.par_bucket(128, 132) == "mid"
    assert cache.par_bucket(512, 132) == "high"
    assert cache.user_cache_path(H200).name == "nvidia-h200-sm90.json"
    assert H200.family == "h200" and DeviceInfo("NVIDIA H200 NVL", (9, 0)).family == "h200"


def test_round_trip_through_tiles(isolated_cache):
    path = cache.write_entries(H200, {key("state"): entry(state_cfg(), ms=1.0, default_ms=1.2)})
    assert path == isolated_cache / "cache" / "nvidia-h200-sm90.json"
    doc = json.loads(path.read_text())
    assert doc["format"] == 1 and doc["device"] == "NVIDIA H200" and "\n  " in path.read_text()
    with use_device(H200):
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == state_cfg()
        assert tiles(SPEC, "state", **SHAPE) == state_cfg()          # H and T unknown: any bucket
        assert tiles(SPEC, "state", **dict(SHAPE, HV=16)) == default_tiles("state", **dict(SHAPE, HV=16))
        assert tiles(SPEC, "output", **SHAPE) == default_tiles("output", **SHAPE)
    with use_device(None):                                           # CPU: never consulted
        assert tiles(SPEC, "state", **SHAPE) == default_tiles("state", **SHAPE)
    with use_device(DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108)):
        assert tiles(SPEC, "state", **SHAPE) == default_tiles("state", **SHAPE)


def test_lookups_read_each_file_once(monkeypatch):
    cache.write_entries(H200, {key("state"): entry(state_cfg())})
    cache.clear_memo()
    reads = []
    original = cache._read
    monkeypatch.setattr(cache, "_read", lambda path: reads.append(path) or original(path))
    with use_device(H200):
        for _ in range(50):
            for stage in space.STAGES:
                tiles(SPEC, stage, **SHAPE)
    assert len(reads) == 2                      # the user file and the (missing) shipped file


def test_tiles_memo_resolves_each_shape_once_and_follows_every_change(isolated_cache, monkeypatch):
    """tiles() answers a repeated launch shape from its memo; an override, a cache write, another
    device or cache folder still change the answer at once."""
    calls = []
    original = cache.lookup
    monkeypatch.setattr(cache, "lookup", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    with use_device(H200):
        for _ in range(20):
            assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == default_tiles("state", **SHAPE)
        assert len(calls) == 1
        mine = tiles(SPEC, "state", H=16, T=8192, **SHAPE)
        mine["BV"] = 999                                          # the caller's copy, not the memo's
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE)["BV"] != 999
        with override(SPEC, "state", num_warps=2):                # an override after a memoised answer
            assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == dict(default_tiles("state", **SHAPE), num_warps=2)
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == default_tiles("state", **SHAPE)
        cache.write_entries(H200, {key("state"): entry(state_cfg(bv=16))})   # a tuning run writes the cache
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == state_cfg(bv=16)
        assert tiles(SPEC, "state", H=16, T=100, **SHAPE) == default_tiles("state", **SHAPE)   # short: no entry
    with use_device(H100):                                        # another device: its own answer
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == default_tiles("state", **SHAPE)
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(isolated_cache / "elsewhere"))   # another cache folder
    with use_device(H200):
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == default_tiles("state", **SHAPE)
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(isolated_cache / "cache"))
    with use_device(H200):
        assert tiles(SPEC, "state", H=16, T=8192, **SHAPE) == state_cfg(bv=16)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 2, "device": "NVIDIA H200",
                                                              "capability": [9, 0], "entries": {}}),
                                     json.dumps({"format": 1, "device": "NVIDIA H200", "capability": [9, 0],
                                                 "entries": {"gated_delta_rule/state/x": {"config": "BV=32"}}}),
                                     json.dumps([1, 2, 3])])
def test_corrupt_cache_warns_once_and_uses_defaults(isolated_cache, content):
    path = cache.user_cache_path(H200)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with use_device(H200), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tiles(SPEC, "state", **SHAPE) == default_tiles("state", **SHAPE)
            assert tiles(SPEC, "output", **SHAPE) == default_tiles("output", **SHAPE)
    mine = [w for w in caught if issubclass(w.category, cache.CacheWarning)]
    assert len(mine) == 1
    assert "corrupt" in str(mine[0].message) or "not valid JSON" in str(mine[0].message)


@pytest.mark.parametrize("stale", [dict(spec_hash="0" * 16), dict(triton="0.0.1")])
def test_stale_entry_warns_and_is_ignored(stale):
    e = entry(state_cfg())
    e.update(stale)
    cache.write_entries(H200, {key("state"): e})
    with use_device(H200), pytest.warns(cache.CacheWarning, match="ignoring"):
        assert tiles(SPEC, "state", **SHAPE) == default_tiles("state", **SHAPE)


def test_unsafe_entry_is_never_used():
    bad = {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 3}          # the known miscompile
    cache.write_entries(H200, {key("output", K=64, V=32): entry(bad)})
    with use_device(H200), pytest.warns(cache.CacheWarning, match="not a valid or safe"):
        assert tiles(SPEC, "output", **dict(SHAPE, K=64, V=32)) == default_tiles("output", **dict(SHAPE, K=64, V=32))


def test_fallback_chain_override_user_shipped_default(isolated_cache):
    shipped = isolated_cache / "shipped"
    shipped.mkdir()
    doc = {"format": 1, "device": "NVIDIA H200 NVL", "capability": [9, 0],
           "entries": {key("state"): entry(state_cfg(bv=16)), key("output"): entry(
               {"BK": 128, "BV": 128, "num_warps": 8, "num_stages": 2})}}
    (shipped / "h200.json").write_text(json.dumps(doc))
    cache.write_entries(H200, {key("state"): entry(state_cfg(bv=32))})
    with use_device(H200):
        assert tiles(SPEC, "state", **SHAPE) == state_cfg(bv=32)                 # user cache
        assert tiles(SPEC, "output", **SHAPE)["num_warps"] == 8                  # shipped
        assert tiles(SPEC, "wy", **SHAPE) == default_tiles("wy", **SHAPE)        # default
        with override(SPEC, "state", num_warps=2):                               # override beats all
            assert tiles(SPEC, "state", **SHAPE) == dict(default_tiles("state", **SHAPE), num_warps=2)
        assert tiles(SPEC, "state", **SHAPE) == state_cfg(bv=32)
    with use_device(H100):                                   # another family: no shipped table
        assert tiles(SPEC, "output", **SHAPE) == default_tiles("output", **SHAPE)


def test_no_shipped_file_for_a_device_is_fine():
    with use_device(DeviceInfo("NVIDIA B200", (10, 0), sm_count=148)), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tiles(SPEC, "state", **SHAPE) == default_tiles("state", **SHAPE)


# ---- tuner ---------------------------------------------------------------------------------

def test_check_outputs_rejects_wrong_and_nan():
    o, h = torch.randn(2, 8, 2, 16), torch.randn(1, 2, 16, 16)
    assert check_outputs((o.clone(), h.clone()), (o, h), torch.float32) is None
    wrong = o.clone()
    wrong[:, 4:] = 0.0
    assert "rel_rmse" in check_outputs((wrong, h), (o, h), torch.float32)
    nan = o.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert check_outputs((nan, h), (o, h), torch.float32) is not None


def test_tuner_rejects_a_wrong_fastest_candidate(gdn, monkeypatch):
    spec = gdn.SPEC
    sizes = dict(K=16, V=16, BT=16, N=1, HV=2, dtype=torch.float32)
    default = default_tiles("output", **sizes)
    wrong = {"BK": 16, "BV": 16, "num_warps": 4, "num_stages": 1}     # miscompiled: rows 16+ wrong
    crash = {"BK": 16, "BV": 16, "num_warps": 2, "num_stages": 1}     # fails to compile
    forget = {"BK": 16, "BV": 16, "num_warps": 8, "num_stages": 1}    # leaves rows unwritten
    right = {"BK": 16, "BV": 32, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(space, "candidates", lambda stage, **kw: [default, wrong, crash, forget, right])
    fn = getattr(gdn, spec.chunk_function)

    def runner(inputs, BT):
        cfg = tiles(spec.name, "output", **sizes)
        if cfg == crash:
            raise RuntimeError("PassManager::run failed (pretend compile error)")
        o, ht = fn(**inputs, output_final_state=True, chunk_size=BT)
        if cfg == wrong:
            o = o.clone()
            o[:, 16:] *= -1
        if cfg == forget:
            out = torch.empty_like(o)          # poisoned by the tuner: the unwritten rows are NaN
            out[:, :8] = o[:, :8]
            o = out
        return o, ht

    times = [(wrong, 0.1), (crash, 0.2), (forget, 0.3), (right, 1.0), (default, 3.0)]
    timed = []

    def timer(f, cand):
        f()
        timed.append(cand.config)
        return next(ms for c, ms in times if c == cand.config)

    report = tune(spec, [(1, 24, 1, 2, 16, 16)], stages=["output"], chunk_sizes=[16], device=H200, runner=runner,
                  timer=timer, write=False)
    (result,) = report.results
    reasons = {json.dumps(c.config): c.rejected for c in result.candidates}
    assert "rel_rmse" in reasons[json.dumps(wrong)]
    assert "PassManager" in reasons[json.dumps(crash)]
    assert "rel_rmse inf" in reasons[json.dumps(forget)]
    assert result.winner.config == right and result.winner.ms == 1.0
    assert timed == [default, right]                     # rejected candidates are never timed
    assert "rejected" in format_report(report)


def test_tuner_end_to_end_writes_winners_that_tiles_serves(gdn, isolated_cache):
    spec = gdn.SPEC
    case = ShapeCase(1, 40, 1, 2, 16, 16, torch.float32)
    picks = {}

    def timer(fn, cand):                 # prefer the last candidate of each stage
        fn()
        picks.setdefault(cand.stage, []).append(cand.config)
        return 10.0 - len(picks[cand.stage])

    report = tune(spec, [case], chunk_sizes=[16], device=H200, timer=timer, max_candidates=2, progress=False)
    # state_output: the state pass of a forward nothing differentiates, tuned on such a forward
    assert [r.stage for r in report.results] == ["wy", "state", "output", "state_output"]
    for r in report.results:
        assert len(r.candidates) == 2 and not r.rejected
        assert r.winner.config == picks[r.stage][-1] and not r.winner.is_default
    assert report.chunk_winners[case] == 16
    doc = json.loads((isolated_cache / "cache" / "nvidia-h200-sm90.json").read_text())
    assert len(doc["entries"]) == 5 and all(e["spec_hash"] == spec.hash for e in doc["entries"].values())
    sizes = dict(K=16, V=16, BT=16, N=1, HV=2, dtype=torch.float32)
    inputs = make_inputs(spec, B=1, T=40, H=1, HV=2, K=16, V=16)
    with use_device(H200):
        for r in report.results:
            assert tiles(spec.name, r.stage, H=1, T=40, **sizes) == r.winner.config
        # the tuned configs really launch, and stay right against the float64 reference
        o, ht = call(gdn, spec, inputs, output_final_state=True, chunk_size=16)
        assert cache.chunk_size_hint(spec.name, K=16, V=16, N=1, HV=2, dtype=torch.float32, T=40) == 16
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) < 1e-5 and rel_rmse(ht, ht_ref) < 1e-5


def test_cli_tune_without_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from gdngen.cli import main
    assert main(["tune", "gated_delta_rule"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_cli_tune_interpret_smoke(isolated_cache, capsys):
    from gdngen.cli import main
    rc = main(["tune", "gated_delta_rule", "--interpret", "--shapes", "1,20,1,2,16,16", "--stages", "state",
               "--chunk-sizes", "16", "--max-candidates", "2", "--cache-dir", str(isolated_cache / "c")])
    captured = capsys.readouterr()
    assert rc == 0 and "smoke test" in captured.err and "state" in captured.out
    assert (isolated_cache / "c" / f"{INTERPRETER_DEVICE.slug}.json").exists()
