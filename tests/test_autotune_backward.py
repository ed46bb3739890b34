"""Backward stages in the autotuner on CPU: search space, cache keys, backward_tiles' lookup chain,
the tuner on forward + backward steps (fake timers, an injected wrong candidate), the CLI."""
import importlib
import json
import warnings
from unittest import mock

import pytest
import torch

from gdngen.autotune import cache, space
from gdngen.autotune.device import DeviceInfo, use_device
from gdngen.autotune.tuner import (INTERPRETER_DEVICE, check_grads, cotangents, format_report,
                                   make_backward_runner, tune)
from gdngen.runtime import tiles
from gdngen.runtime import backward_tiles as bt
from gdngen.runtime.backward_tiles import backward_tiles, default_backward_tiles, override_backward
from gdngen.runtime.tiles import default_tiles
from gdngen.selfcheck import make_inputs, poisoned_memory
from gdngen.spec import load_spec

H200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)
SMALL = DeviceInfo("Some Future GPU", (13, 7), sm_count=40)          # 48 KiB fallback shared memory
BF16 = torch.bfloat16
SHAPE = dict(K=128, V=128, BT=64, N=4, HV=32, dtype=BF16)
SPEC = "gated_delta_rule"
RUNTIME = {s: space.runtime_stage(s) for s in space.BACKWARD_STAGES}


pytestmark = pytest.mark.usefixtures("isolated_cache")    # conftest: an empty cache per test


def entry(config, **kw):
    kw.setdefault("spec_hash", cache.spec_hash_for(SPEC))
    return cache.make_entry(config, **kw)


def key(stage, H=16, T=8192, spec=SPEC, **over):
    shape = dict(SHAPE, **over)
    return cache.entry_key(spec, stage, cache.shape_class(H=H, HV=shape["HV"], K=shape["K"], V=shape["V"],
                                                          dtype=shape["dtype"], BT=shape["BT"], N=shape["N"],
                                                          T=T, sm_count=132))


def lookup_args(**over):
    return dict(SHAPE, spec_name=SPEC, H=16, T=8192, **over)


# ---- search space --------------------------------------------------------------------------

@pytest.mark.parametrize("device", [H200, SMALL])
@pytest.mark.parametrize("K,V,BT,dtype", [(128, 128, 64, BF16), (256, 256, 64, torch.float32),
                                          (20, 100, 16, BF16), (64, 32, 32, torch.float16)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_backward_candidates_respect_hard_rules_and_limits(device, K, V, BT, dtype, per_channel):
    for stage in space.BACKWARD_STAGES:
        default = default_backward_tiles(RUNTIME[stage], K=K, V=V, BT=BT, N=4, HV=32, dtype=dtype)
        found = space.candidates(stage, K=K, V=V, BT=BT, dtype=dtype, default=default, device=device,
                                 per_channel=per_channel)
        assert found[0] == default and default not in found[1:]
        assert set(default) == set(space.config_keys(stage))
        for c in found:
            assert space.is_valid(stage, c, K=K, V=V), (stage, c)
            assert all(c[t] >= 16 and not c[t] & (c[t] - 1) for t in ("BK", "BV") if t in c)
            if stage == "state_bwd":
                assert c["BK"] >= K and c["num_stages"] >= 2
            if stage in ("intra_bwd", "chunk_bwd", "wy_bwd"):
                # the Hopper miscompile rule (intra's key tile is only a contraction width)
                assert c["BK"] >= (space.INTRA_MIN_BK if stage == "intra_bwd" else 64) and c["BV"] >= 64
            if stage not in ("state_bwd", "intra_bwd"):
                assert c["num_stages"] == default["num_stages"]   # static_range loops only
        for c in found[1:]:
            assert space.regs_per_thread(stage, c, BT=BT, per_channel=per_channel) <= space.REG_LIMIT
            assert space.smem_bytes(stage, c, BT=BT, dtype=dtype) <= device.smem
        assert len(space.candidates(stage, K=K, V=V, BT=BT, dtype=dtype, default=default, device=device,
                                    limit=3)) <= 3


def test_backward_space_is_pruned_by_the_estimates():
    default = default_backward_tiles("chunk", **dict(SHAPE, K=256, V=256))
    pruned = []
    found = space.candidates("chunk_bwd", K=256, V=256, BT=64, dtype=BF16, default=default, device=H200,
                             pruned=pruned)
    big = {"BK": 256, "BV": 256, "num_warps": 2, "num_stages": 2}
    assert big not in found and any(c == big and "registers" in why for c, why in pruned)
    # the [16, 16, BK] sub-block products of per-channel decay take more registers
    vector = space.candidates("chunk_bwd", K=256, V=256, BT=64, dtype=BF16, default=default, device=H200,
                              per_channel=True)
    assert len(vector) < len(found) and all(c in found for c in vector)
    # a small device's shared memory prunes more of the reverse state pass
    state = default_backward_tiles("state", **dict(SHAPE, K=256, V=256, dtype=torch.float32))
    on_h200 = space.candidates("state_bwd", K=256, V=256, BT=64, dtype=torch.float32, default=state, device=H200)
    on_small = space.candidates("state_bwd", K=256, V=256, BT=64, dtype=torch.float32, default=state, device=SMALL)
    assert len(on_small) < len(on_h200)


@pytest.mark.parametrize("stage,config,why", [
    ("state_bwd", {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 2}, "whole K"),
    ("state_bwd", {"BK": 128, "BV": 32, "num_warps": 4, "num_stages": 1}, "num_stages"),
    ("chunk_bwd", {"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 2}, "below 64"),
    ("wy_bwd", {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 2}, "below 64"),
    ("intra_bwd", {"BK": 64, "BV": 48, "num_warps": 4, "num_stages": 2}, "power of two"),
    ("intra_bwd", {"BK": 16, "BV": 64, "num_warps": 4, "num_stages": 2}, "below 32"),
    ("intra_bwd", {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 2}, "below 64"),
    ("wy_prep_bwd", {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2}, "keys"),
    ("chunk_bwd", {"BK": 64, "num_warps": 4, "num_stages": 2}, "keys"),
])
def test_backward_problem_names_the_rule(stage, config, why):
    assert why in space.backward_problem(stage, config, K=128, V=128)
    assert not space.is_valid(stage, config, K=128, V=128)
    assert space.is_valid("wy_prep_bwd", {"BK": 32, "num_warps": 4, "num_stages": 2}, K=128, V=128)


def test_backward_persistent_grid_is_a_tuning_option_where_a_kernel_has_one():
    """PERSISTENT (programs per SM, absent = one program per tile) is an optional key of the wy_prep,
    chunk and wy backward stages (scalar decay; wy_prep for every spec), tried after the plain tiles
    where it fits (the scalar wy kernel's persistent twin needs 232 KiB at K=V=128: offered at 64)."""
    for stage, per_channel, offered, dim in (("chunk_bwd", False, True, 128), ("chunk_bwd", True, False, 128),
                                             ("wy_bwd", False, False, 128), ("wy_bwd", False, True, 64),
                                             ("wy_bwd", True, False, 128),
                                             ("wy_prep_bwd", True, True, 128), ("intra_bwd", False, False, 128),
                                             ("state_bwd", False, False, 128)):
        default = default_backward_tiles(RUNTIME[stage], K=dim, V=dim, BT=64, N=1, HV=32, dtype=BF16)
        found = space.candidates(stage, K=dim, V=dim, BT=64, dtype=BF16, default=default, device=H200,
                                 per_channel=per_channel)
        assert (dict(default, PERSISTENT=1) in found) == offered, (stage, per_channel)
        if offered:      # after every one-program-per-tile config, the default's own twin first
            persistent = [i for i, c in enumerate(found) if "PERSISTENT" in c]
            assert persistent == list(range(persistent[0], len(found))), stage
            assert found[persistent[0]] == dict(default, PERSISTENT=1), stage
        assert all(set(c) - set(space.config_keys(stage)) <= {"PERSISTENT"} for c in found)
    chunk = {"BK": 64, "BV": 128, "num_warps": 4, "num_stages": 2}
    assert space.is_valid("chunk_bwd", dict(chunk, PERSISTENT=1), K=128, V=128)
    for bad, why in ((dict(chunk, PERSISTENT=0), "PERSISTENT=0"), (dict(chunk, PERSISTENT=True), "integer"),
                     (dict(chunk, PERSISTENT=1, TILES=2), "keys")):
        assert why in space.backward_problem("chunk_bwd", bad, K=128, V=128), bad
    assert "keys" in space.backward_problem("intra_bwd", dict(chunk, PERSISTENT=1), K=128, V=128)
    # shared memory: every load of the tile loop buffered per stage
    assert space.smem_bytes("chunk_bwd", dict(chunk, PERSISTENT=1), BT=64, dtype=BF16) > \
        space.smem_bytes("chunk_bwd", chunk, BT=64, dtype=BF16)


def test_persistent_wy_bwd_shared_memory_counts_every_unrolled_load():
    """The scalar wy_bwd kernel unrolls its value and key tiles, and a persistent grid buffers each load site
    per pipeline stage: the estimate follows the offline sm_90 figures (bf16, BK=BV=64, two stages: 232 KiB at
    K=V=128, 144 at K=128 / V=64, 96 at K=V=64), so the two-stage config is pruned at K=V=128 on the H200 (it
    failed to compile there at stop 38) and offered at K=V=64."""
    wy = {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2, "PERSISTENT": 1}
    for (K, V), offline_kib in (((128, 128), 232), ((128, 64), 144), ((64, 64), 96)):
        kib = space.smem_bytes("wy_bwd", wy, BT=64, dtype=BF16, K=K, V=V) / 1024
        assert offline_kib <= kib <= 1.1 * offline_kib, (K, V, kib)
    assert "shared memory" in space.fits("wy_bwd", wy, BT=64, dtype=BF16, device=H200, K=128, V=128)
    assert space.fits("wy_bwd", wy, BT=64, dtype=BF16, device=H200, K=64, V=64) is None
    default = default_backward_tiles("wy", **SHAPE)
    pruned = []
    found = space.candidates("wy_bwd", K=128, V=128, BT=64, dtype=BF16, default=default, device=H200, pruned=pruned)
    assert wy not in found and any(c == wy and "shared memory" in why for c, why in pruned)


def test_backward_persistent_entry_round_trip(isolated_cache):
    chunk = {"BK": 64, "BV": 128, "num_warps": 4, "num_stages": 2, "PERSISTENT": 1}
    cache.write_entries(H200, {key("chunk_bwd"): entry(chunk)})
    with use_device(H200):
        assert backward_tiles("chunk", **lookup_args()) == chunk


def test_stage_names_groups_and_which_specs_launch_what():
    assert space.expand_stages(["bwd"]) == list(space.BACKWARD_STAGES)
    assert space.expand_stages(["state_bwd", "state", "fwd"]) == ["wy", "state", "output", "state_output", "state_bwd"]
    assert space.expand_stages(["all"]) == list(space.ALL_STAGES)
    with pytest.raises(ValueError, match="unknown"):
        space.expand_stages(["state_backward"])
    assert [space.runtime_stage(s) for s in space.BACKWARD_STAGES] == list(bt.STAGES)
    launched = {name: space.backward_stages_for(load_spec(f"specs/{name}.yaml"))
                for name in ("gated_delta_rule", "kda", "gla", "linear_attn")}
    assert launched["gated_delta_rule"] == ["wy_prep_bwd", "intra_bwd", "state_bwd", "chunk_bwd", "wy_bwd"]
    assert launched["kda"] == launched["gated_delta_rule"] + ["wy_decay_bwd"]
    assert launched["gla"] == launched["linear_attn"] == ["intra_bwd", "state_bwd", "chunk_bwd"]


# ---- cache and lookup ----------------------------------------------------------------------

def test_backward_round_trip_through_backward_tiles(isolated_cache):
    state = {"BK": 128, "BV": 16, "num_warps": 4, "num_stages": 3}
    chunk = {"BK": 128, "BV": 64, "num_warps": 8, "num_stages": 2}
    prep = {"BK": 128, "num_warps": 2, "num_stages": 2}
    path = cache.write_entries(H200, {key("state_bwd"): entry(state), key("chunk_bwd"): entry(chunk),
                                      key("wy_prep_bwd"): entry(prep)})
    doc = json.loads(path.read_text())
    assert f"{SPEC}/state_bwd/H=16,HV=32,K=128,V=128,dtype=bfloat16,BT=64,par=mid,T=long" in doc["entries"]
    with use_device(H200):
        assert backward_tiles("state", **lookup_args()) == state
        assert backward_tiles("chunk", **lookup_args()) == chunk
        assert backward_tiles("wy_prep", **lookup_args()) == prep
        assert backward_tiles("state", **dict(SHAPE, spec_name=SPEC)) == state      # H, T unknown: any bucket
        assert backward_tiles("wy", **lookup_args()) == default_backward_tiles("wy", **SHAPE)
        assert backward_tiles("state", **SHAPE) == default_backward_tiles("state", **SHAPE)   # no spec: defaults
        assert backward_tiles("state", **lookup_args(HV=16)) == default_backward_tiles("state", **dict(SHAPE, HV=16))
        # the forward and backward state passes have separate entries
        assert tiles(SPEC, "state", **SHAPE) == default_tiles("state", **SHAPE)
    with use_device(None):                                                          # CPU: never consulted
        assert backward_tiles("state", **lookup_args()) == default_backward_tiles("state", **SHAPE)


def test_backward_fallback_chain_override_user_shipped_default(isolated_cache):
    shipped = isolated_cache / "shipped"
    shipped.mkdir()
    doc = {"format": 1, "device": "NVIDIA H200 NVL", "capability": [9, 0],
           "entries": {key("state_bwd"): entry({"BK": 128, "BV": 16, "num_warps": 4, "num_stages": 2}),
                       key("intra_bwd"): entry({"BK": 128, "BV": 128, "num_warps": 8, "num_stages": 3})}}
    (shipped / "h200.json").write_text(json.dumps(doc))
    user_state = {"BK": 128, "BV": 32, "num_warps": 2, "num_stages": 4}
    cache.write_entries(H200, {key("state_bwd"): entry(user_state)})
    with use_device(H200):
        assert backward_tiles("state", **lookup_args()) == user_state                        # user cache
        assert backward_tiles("intra", **lookup_args())["num_warps"] == 8                     # shipped
        assert backward_tiles("chunk", **lookup_args()) == default_backward_tiles("chunk", **SHAPE)   # default
        with override_backward("state", num_warps=8):                                         # override beats all
            assert backward_tiles("state", **lookup_args()) == dict(default_backward_tiles("state", **SHAPE),
                                                                    num_warps=8)
        assert backward_tiles("state", **lookup_args()) == user_state
    with use_device(DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), sm_count=132)):             # no shipped table
        assert backward_tiles("intra", **lookup_args()) == default_backward_tiles("intra", **SHAPE)


def test_backward_tiles_memo_follows_overrides_cache_writes_and_devices(monkeypatch):
    calls = []
    original = cache.lookup
    monkeypatch.setattr(cache, "lookup", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    state = {"BK": 128, "BV": 16, "num_warps": 4, "num_stages": 3}
    with use_device(H200):
        for _ in range(20):
            assert backward_tiles("state", **lookup_args()) == default_backward_tiles("state", **SHAPE)
        assert len(calls) == 1
        backward_tiles("state", **lookup_args())["BV"] = 999     # the caller's copy, not the memo's
        with override_backward("state", num_warps=8):             # an override after a memoised answer
            assert backward_tiles("state", **lookup_args())["num_warps"] == 8
        assert backward_tiles("state", **lookup_args()) == default_backward_tiles("state", **SHAPE)
        cache.write_entries(H200, {key("state_bwd"): entry(state)})
        assert backward_tiles("state", **lookup_args()) == state
    with use_device(None):                                        # CPU: never consulted
        assert backward_tiles("state", **lookup_args()) == default_backward_tiles("state", **SHAPE)


@pytest.mark.parametrize("stage,config", [
    ("state_bwd", {"BK": 128, "BV": 32, "num_warps": 4, "num_stages": 1}),      # illegal accesses on the H200
    ("state_bwd", {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 2}),       # would drop key rows
    ("chunk_bwd", {"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 2}),       # the Hopper miscompile
    ("wy_bwd", {"BK": 64, "num_warps": 4, "num_stages": 2}),                    # missing BV
])
def test_unsafe_backward_entry_warns_and_is_ignored(stage, config):
    cache.write_entries(H200, {key(stage): entry(config)})
    runtime = RUNTIME[stage]
    with use_device(H200), pytest.warns(cache.CacheWarning, match="not a valid or safe"):
        assert backward_tiles(runtime, **lookup_args()) == default_backward_tiles(runtime, **SHAPE)


@pytest.mark.parametrize("stale", [dict(spec_hash="0" * 16), dict(triton="0.0.1")])
def test_stale_backward_entry_warns_and_is_ignored(stale):
    e = entry({"BK": 128, "BV": 16, "num_warps": 4, "num_stages": 3})
    e.update(stale)
    cache.write_entries(H200, {key("state_bwd"): e})
    with use_device(H200), pytest.warns(cache.CacheWarning, match="ignoring"):
        assert backward_tiles("state", **lookup_args()) == default_backward_tiles("state", **SHAPE)


def test_corrupt_cache_warns_once_for_backward_lookups():
    path = cache.user_cache_path(H200)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with use_device(H200), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for stage in bt.STAGES:
                assert backward_tiles(stage, **lookup_args()) == default_backward_tiles(stage, **SHAPE)
    mine = [w for w in caught if issubclass(w.category, cache.CacheWarning)]
    assert len(mine) == 1 and "not valid JSON" in str(mine[0].message)


def test_a_bad_config_past_the_cache_checks_never_crashes_a_launch(monkeypatch):
    monkeypatch.setattr(cache, "lookup", lambda *a, **kw: {"num_stages": 1})
    with use_device(H200), pytest.warns(cache.CacheWarning, match="not safe"):
        assert backward_tiles("state", **lookup_args()) == default_backward_tiles("state", **SHAPE)
    with override_backward("state", num_stages=1), pytest.raises(ValueError, match="num_stages"):
        backward_tiles("state", **lookup_args())          # an explicit override still raises


def test_generated_backward_passes_the_cache_key_facts():
    module = importlib.import_module(f"generated.{SPEC}")
    spec = module.SPEC
    seen = []

    def recording(stage, **shape):
        seen.append((stage, shape))
        return bt.backward_tiles(stage, **shape)

    inputs = make_inputs(spec, B=1, T=20, H=1, HV=2, K=16, V=16)
    with mock.patch.object(module, "backward_tiles", side_effect=recording):
        make_backward_runner(getattr(module, spec.chunk_function), cotangents(inputs))(inputs, 16)
    assert [s for s, _ in seen] == ["wy_prep", "intra", "state", "chunk", "wy"]
    for _, shape in seen:
        assert shape["spec_name"] == SPEC and shape["spec_hash"] == spec.hash
        assert (shape["H"], shape["T"], shape["N"], shape["HV"]) == (1, 20, 1, 2)


# ---- tuner ---------------------------------------------------------------------------------

def test_check_grads_rejects_wrong_nan_and_missing():
    want = {"o": torch.randn(2, 8), "dq": torch.randn(2, 8), "dg": torch.randn(2, 3)}
    assert check_grads({k: v.clone() for k, v in want.items()}, want, torch.float32) is None
    wrong = dict(want, dg=want["dg"] * -1)
    assert check_grads(wrong, want, torch.float32).startswith("dg rel_rmse")
    nan = dict(want, dq=torch.full_like(want["dq"], float("nan")))
    assert "dq rel_rmse inf" in check_grads(nan, want, torch.float32)
    assert "missing" in check_grads({k: v for k, v in want.items() if k != "dg"}, want, torch.float32)


def test_tuner_picks_the_fastest_correct_backward_candidate(isolated_cache, monkeypatch):
    module = importlib.import_module(f"generated.{SPEC}")
    spec = module.SPEC
    sizes = dict(K=16, V=16, BT=16, N=1, HV=2, dtype=torch.float32)
    default = default_backward_tiles("chunk", **sizes)
    wrong = {"BK": 64, "BV": 64, "num_warps": 8, "num_stages": 2}     # miscompiled: dk wrong
    crash = {"BK": 64, "BV": 64, "num_warps": 2, "num_stages": 2}     # fails to compile
    forget = {"BK": 64, "BV": 64, "num_warps": 1, "num_stages": 2}    # leaves dq unwritten
    right = {"BK": 128, "BV": 64, "num_warps": 4, "num_stages": 2}
    slower = {"BK": 64, "BV": 128, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(space, "candidates", lambda stage, **kw: [default, wrong, crash, forget, right, slower])
    inputs_seen = []

    def runner(inputs, BT):
        cfg = bt.backward_tiles("chunk", **sizes)          # what the generated backward gets now
        if cfg == crash:
            raise RuntimeError("PassManager::run failed (pretend compile error)")
        inputs_seen.append(cfg)
        out = make_backward_runner(getattr(module, spec.chunk_function), cotangents(inputs))(inputs, BT)
        if cfg == wrong:
            out["dk"] = out["dk"].clone()
            out["dk"][:, 8:] *= -1
        if cfg == forget:
            dq = torch.empty_like(out["dq"])   # poisoned by the tuner: the unwritten rows are NaN
            dq[:, :4] = out["dq"][:, :4]
            out["dq"] = dq
        return out

    times = [(wrong, 0.1), (crash, 0.2), (forget, 0.3), (right, 1.0), (slower, 2.0), (default, 3.0)]
    timed = []

    def timer(f, cand):
        timed.append(cand.config)
        return next(ms for c, ms in times if c == cand.config)

    report = tune(spec, [(1, 20, 1, 2, 16, 16)], stages=["chunk_bwd"], chunk_sizes=[16], device=H200,
                  backward_runner=runner, timer=timer)
    (result,) = report.results
    reasons = {json.dumps(c.config): c.rejected for c in result.candidates}
    assert reasons[json.dumps(wrong)].startswith("dk rel_rmse")
    assert "PassManager" in reasons[json.dumps(crash)]
    assert reasons[json.dumps(forget)].startswith("dq rel_rmse inf")
    assert result.stage == "chunk_bwd" and result.winner.config == right and result.winner.ms == 1.0
    assert timed == [default, right, slower]                 # rejected candidates are never timed
    assert "rejected" in format_report(report) and "fwd+bwd chunk size" in format_report(report)
    assert report.train_chunk_winners and not report.chunk_winners     # no forward stage was tuned
    doc = json.loads((isolated_cache / "cache" / "nvidia-h200-sm90.json").read_text())
    assert sorted(k.split("/")[1] for k in doc["entries"]) == ["chunk_bwd", "chunk_train"]
    with use_device(H200):
        assert backward_tiles("chunk", **sizes, spec_name=SPEC, H=1, T=20) == right
        assert cache.chunk_size_hint(SPEC, K=16, V=16, N=1, HV=2, dtype=torch.float32, T=20, training=True) == 16
        assert cache.chunk_size_hint(SPEC, K=16, V=16, N=1, HV=2, dtype=torch.float32, T=20) is None


@pytest.mark.parametrize("name,stages", [("gated_delta_rule", ["wy", "bwd"]), ("kda", ["wy_decay_bwd"])])
def test_tuner_end_to_end_backward_winners_are_served_and_right(isolated_cache, name, stages):
    module = importlib.import_module(f"generated.{name}")
    spec = module.SPEC
    picks = {}

    def timer(fn, cand):                 # prefer the last candidate of each stage
        picks.setdefault(cand.stage, []).append(cand.config)
        return 10.0 - len(picks[cand.stage])

    report = tune(spec, [(1, 20, 1, 2, 16, 16)], stages=stages, chunk_sizes=[16], device=H200, timer=timer,
                  max_candidates=2)
    expected = ({"gated_delta_rule": ["wy", "wy_prep_bwd", "intra_bwd", "state_bwd", "chunk_bwd", "wy_bwd"],
                 "kda": ["wy_decay_bwd"]}[name])
    assert [r.stage for r in report.results] == expected
    for r in report.results:
        assert len(r.candidates) == 2 and not r.rejected and r.winner.config == picks[r.stage][-1]
    sizes = dict(K=16, V=16, BT=16, N=1, HV=2, dtype=torch.float32)
    inputs = make_inputs(spec, B=1, T=20, H=1, HV=2, K=16, V=16)
    run = make_backward_runner(getattr(module, spec.chunk_function), cotangents(inputs))
    with poisoned_memory():
        want = run(inputs, 16)                           # no device: defaults everywhere
    with use_device(H200):
        for r in report.results:
            if space.is_backward(r.stage):
                assert backward_tiles(RUNTIME[r.stage], **sizes, spec_name=name, H=1, T=20) == r.winner.config
        with poisoned_memory():
            got = run(inputs, 16)                        # the tuned configs really launch
    assert check_grads(got, want, torch.float32) is None


def test_cli_tune_interpret_smoke_with_backward_stages(isolated_cache, capsys):
    from gdngen.cli import main
    rc = main(["tune", SPEC, "--interpret", "--shapes", "1,20,1,2,16,16", "--stages", "state_bwd,chunk_bwd",
               "--chunk-sizes", "16", "--max-candidates", "2", "--cache-dir", str(isolated_cache / "c")])
    captured = capsys.readouterr()
    assert rc == 0 and "smoke test" in captured.err
    assert "state_bwd" in captured.out and "chunk_bwd" in captured.out and "fwd+bwd chunk size" in captured.out
    doc = json.loads((isolated_cache / "c" / f"{INTERPRETER_DEVICE.slug}.json").read_text())
    assert {k.split("/")[1] for k in doc["entries"]} == {"state_bwd", "chunk_bwd", "chunk_train"}


def test_cli_tune_stage_words(capsys):
    from gdngen.autotune import tuner
    from gdngen.cli import main
    seen = []
    fake = lambda spec, shapes, **kw: seen.append(kw["stages"]) or tuner.TuneReport()  # noqa: E731
    with mock.patch.object(tuner, "tune", fake):
        assert main(["tune", SPEC, "--interpret", "--dry-run", "--backward"]) == 0
        assert main(["tune", SPEC, "--interpret", "--dry-run", "--stages", "state", "--backward"]) == 0
    assert seen == [["fwd", "bwd"], ["state", "bwd"]]
    assert main(["tune", SPEC, "--interpret", "--stages", "state_backward"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_per_channel_intra_default_passes_the_register_estimate():
    """The per-channel intra default (BV=128, 8 warps at K=V=128 bf16; 155 registers, no spill under
    ptxas for sm_90) must be a candidate the tuner can keep, and its neighbours timed, not pruned."""
    shape = dict(SHAPE, K=128, V=128, dtype=BF16)
    default = default_backward_tiles("intra", **shape, per_channel=True)
    assert default["BV"] == 128 and default["num_warps"] == 8
    assert space.regs_per_thread("intra_bwd", default, BT=64, per_channel=True) <= space.REG_LIMIT
    pruned = []
    space.candidates("intra_bwd", K=128, V=128, BT=64, dtype=BF16, default=default, device=H200,
                     per_channel=True, pruned=pruned)
    assert not any(c == default for c, _ in pruned)
