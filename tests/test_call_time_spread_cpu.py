"""benchmarks/call_time_spread.py's summary of per-call times (no GPU): nearest-rank percentiles over every call,
each round's median in call order, and bad arguments refused by name."""
import importlib.util
import random

import pytest

from gdngen.render import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("call_time_spread", ROOT / "benchmarks" / "call_time_spread.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_percentiles_and_round_medians():
    summarise = load_script().summarise
    slow = [0.60 + 0.001 * i for i in range(10)]             # a slow round, then a fast one: medians in call order
    fast = [0.50 + 0.001 * i for i in range(10)]
    times = slow[:]
    random.Random(0).shuffle(times)
    row = summarise(times + fast[::-1], 10)
    assert row["calls"] == 20
    assert row["round_medians"] == [0.605, 0.505]
    assert (row["p05"], row["p50"], row["max"]) == (0.501, 0.6, 0.609)    # ranks 1, 10 (of 0 .. 19) and the last
    assert row["p25"] <= row["p50"] <= row["p75"] <= row["p95"] <= row["max"]


@pytest.mark.parametrize("times, per_round, name", [([], 10, "times_ms"), ([0.5] * 7, 3, "calls_per_round"),
                                                    ([0.5] * 6, 0, "calls_per_round")])
def test_bad_arguments_named(times, per_round, name):
    with pytest.raises(ValueError, match=name):
        load_script().summarise(times, per_round)
