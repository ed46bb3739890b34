"""The tuner's intra-card split stage (issue #9): segment counts checked against the unsplit call
before timing, the winner cached per shape class, and read by split_sequence_forward(segments="auto")."""
import json

import pytest
import torch

from gdngen import parallel
from gdngen.parallel import intra_card
from gdngen.autotune import cache
from gdngen.autotune.device import DeviceInfo, use_device
from gdngen.autotune.tuner import ShapeCase, format_split_rows, tune_split
from gdngen.selfcheck import make_inputs

H200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)
CASE = ShapeCase(1, 256, 1, 2, 16, 16, torch.float32)


@pytest.fixture(scope="module")
def gdn():
    import generated.gated_delta_rule as module
    return module


def _timer(ms_by_segments):
    def timer(fn, cand):
        fn()
        return ms_by_segments[cand.config["segments"]]
    return timer


def test_fastest_right_count_wins_and_is_cached(gdn, isolated_cache):
    rows = tune_split(gdn.SPEC, [CASE], chunk_size=16, segment_counts=(1, 2, 4), device=H200,
                      timer=_timer({1: 3.0, 2: 2.0, 4: 1.0}))
    assert [(r["segments"], r.get("rejected"), r["winner"]) for r in rows] == [(1, None, False), (2, None, False),
                                                                               (4, None, True)]
    doc = json.loads((isolated_cache / "cache" / "nvidia-h200-sm90.json").read_text())
    (key, entry), = doc["entries"].items()
    assert key.startswith("gated_delta_rule/split/") and entry["config"] == {"segments": 4}
    assert "winner" in format_split_rows(rows)
    with use_device(H200):
        assert cache.segments_hint("gated_delta_rule", K=16, V=16, BT=16, N=1, HV=2, dtype=torch.float32,
                                   H=1, T=256) == 4


def test_a_wrong_count_is_never_chosen(gdn, isolated_cache, monkeypatch):
    real = parallel.split_sequence_forward

    def broken(fn, *args, segments="auto", **kwargs):
        o, final = real(fn, *args, segments=segments, **kwargs)
        return (o + 1.0, final) if segments == 2 else (o, final)

    monkeypatch.setattr(parallel, "split_sequence_forward", broken)
    rows = tune_split(gdn.SPEC, [CASE], chunk_size=16, segment_counts=(1, 2, 4), device=H200,
                      timer=_timer({1: 3.0, 2: 0.5, 4: 2.0}))
    by = {r["segments"]: r for r in rows}
    assert "ms" not in by[2] and by[2]["rejected"] and not by[2]["winner"] and by[4]["winner"]


def test_no_split_kept_within_timing_noise(gdn, isolated_cache):
    rows = tune_split(gdn.SPEC, [CASE], chunk_size=16, segment_counts=(1, 2), device=H200,
                      timer=_timer({1: 1.0, 2: 0.995}), write=False)
    assert [r["winner"] for r in rows] == [True, False]
    assert not (isolated_cache / "cache").exists()


def test_auto_split_reads_the_tuned_count(gdn, isolated_cache, monkeypatch):
    tune_split(gdn.SPEC, [CASE], chunk_size=16, segment_counts=(1, 4), device=H200, timer=_timer({1: 2.0, 4: 1.0}))
    seen = []
    real = intra_card._split_pieces
    monkeypatch.setattr(intra_card, "_split_pieces", lambda offsets, segment, has_init: seen.append(segment) or
                        real(offsets, segment, has_init))
    inputs = make_inputs(gdn.SPEC, B=1, T=256, H=1, HV=2, K=16, V=16, seed=3)
    with use_device(H200):
        o, final = parallel.split_sequence_forward(gdn.chunk_gated_delta_rule, **inputs, segments="auto",
                                                   output_final_state=True, chunk_size=16)
        assert parallel.choose_segments(gdn.chunk_gated_delta_rule, **inputs, chunk_size=16) == 4
    o_ref, final_ref = gdn.chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=16)
    assert seen == [64]                                   # 256 tokens in 4 segments
    assert torch.allclose(o, o_ref, atol=1e-5, rtol=1e-5) and torch.allclose(final, final_ref, atol=1e-5, rtol=1e-5)


def test_auto_split_untuned_is_no_split(gdn, isolated_cache, monkeypatch):
    """No tuned entry: 'auto' runs the plain op, even where B * HV leaves most of the H200's SMs idle.
    The SM-count heuristic it replaced picked 4-8 segments at (1,131072,16,32) and (1,32768,2,8), and
    each ran ~2x slower than no split on the H200 (benchmarks/results/2026-11-30-h200-stop18-split.txt)."""
    monkeypatch.setattr(intra_card, "_split_pieces", lambda *a: pytest.fail("split without a measured winner"))
    inputs = make_inputs(gdn.SPEC, B=1, T=256, H=1, HV=2, K=16, V=16, seed=3)
    with use_device(H200):
        assert parallel.choose_segments(gdn.chunk_gated_delta_rule, **inputs, chunk_size=16) == 1
        o, final = parallel.split_sequence_forward(gdn.chunk_gated_delta_rule, **inputs, segments="auto",
                                                   output_final_state=True, chunk_size=16)
    o_ref, final_ref = gdn.chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=16)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_auto_split_keeps_a_tuned_no_split(gdn, isolated_cache, monkeypatch):
    """A measured 'no split' (every count slower) is cached as 1 and 'auto' follows it."""
    tune_split(gdn.SPEC, [CASE], chunk_size=16, segment_counts=(1, 2, 4), device=H200,
               timer=_timer({1: 1.0, 2: 2.0, 4: 2.1}))
    monkeypatch.setattr(intra_card, "_split_pieces", lambda *a: pytest.fail("split against the measured winner"))
    inputs = make_inputs(gdn.SPEC, B=1, T=256, H=1, HV=2, K=16, V=16, seed=3)
    with use_device(H200):
        assert cache.segments_hint("gated_delta_rule", K=16, V=16, BT=16, N=1, HV=2, dtype=torch.float32,
                                   H=1, T=256) == 1
        assert parallel.choose_segments(gdn.chunk_gated_delta_rule, **inputs, chunk_size=16) == 1
        parallel.split_sequence_forward(gdn.chunk_gated_delta_rule, **inputs, segments="auto", chunk_size=16)


def test_cli_split_stage_dry_run(isolated_cache, capsys):
    from gdngen.cli import main
    rc = main(["tune", "gated_delta_rule", "--interpret", "--shapes", "1,128,1,2,16,16", "--stages", "split",
               "--chunk-sizes", "16", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "segments" in out and "winner" in out
