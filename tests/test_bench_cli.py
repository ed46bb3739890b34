"""``gdngen bench`` on CPU: row schema, the incremental rows file, the time-budget stop, the PNG writer.

Timing is faked (a fake clock and timer, tiny implementations) so nothing here needs a GPU; one test
runs the real CLI end to end on the Triton interpreter with one tiny case.
"""
import json
import struct
import sys
import time
import zlib

import pytest
import torch

from gdngen import bench
from gdngen.cli import main
from gdngen.render import ROOT
from gdngen.spec import load_spec

SCHEMA = {"op", "mode", "impl", "B", "T", "H", "HV", "K", "V", "dtype", "ms", "peak_mib"}
SPEC = load_spec(ROOT / "specs" / "gated_delta_rule.yaml")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_impl(inputs):
    """A differentiable stand-in with the output shape [B, T, HV, V]."""
    return inputs["v"] * inputs["beta"][..., None] + inputs["q"].sum() * 0


def read_png(path):
    """Decode our own PNG (8-bit RGB, filter 0): (width, height, rows of bytes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    rows = [raw[y * (1 + 3 * width) + 1:(y + 1) * (1 + 3 * width)] for y in range(height)]
    assert all(raw[y * (1 + 3 * width)] == 0 for y in range(height))
    return width, height, rows


def count_colour(rows, colour):
    target = bytes(colour)
    return sum(sum(1 for x in range(0, len(r), 3) if r[x:x + 3] == target) for r in rows)


def test_rows_schema_and_incremental_file(tmp_path, monkeypatch):
    """Every (case, mode, impl) gives a schema row, and the file holds each row as soon as it is measured."""
    out = tmp_path / "rows.json"
    rows = bench.RowFile(out)
    seen_on_disk = []
    clock = FakeClock()

    def timer(step, device, grad_to_none=None):
        step()                                   # the step really runs (fwd, or fwd+bwd with a backward)
        seen_on_disk.append(len(json.loads(out.read_text())) if out.exists() else 0)
        clock.now += 1.0
        return 2.0

    plan = [(bench.Case("a", 1, 32, 1, 2, 8, 8), bench.MODES), (bench.Case("b", 2, 16, 1, 1, 8, 8), ("fwd",))]

    def failing(inputs):
        raise RuntimeError("boom")

    impls = {"gdngen": fake_impl, "broken": failing}
    summary = bench.run_bench(SPEC, plan, impls, rows, device="cpu", dtype=torch.float32,
                              budget=bench.Budget(None, clock=clock), timer=timer,
                              progress=bench.Progress(6, clock=clock))
    assert summary == {"measured": 3, "failed": 3, "skipped": []}
    # the file had 0, 2, 4 rows when the three timed rows ran: written after every row, failures included
    assert seen_on_disk == [0, 2, 4]
    on_disk = json.loads(out.read_text())
    assert on_disk == rows.rows and len(on_disk) == 6
    for row in on_disk:
        assert SCHEMA <= set(row)
        assert row["op"] == "chunk_gated_delta_rule" and row["dtype"] == "float32"
    good = [r for r in on_disk if r["impl"] == "gdngen"]
    assert [(r["mode"], r["case"]) for r in good] == [("fwd", "a"), ("fwd+bwd", "a"), ("fwd", "b")]
    assert all(r["ms"] == 2.0 and r["tokens_per_s"] == r["B"] * r["T"] / 2.0 * 1e3 for r in good)
    assert all(r["peak_mib"] is None and "error" not in r for r in good)      # no CUDA: no peak memory
    bad = [r for r in on_disk if r["impl"] == "broken"]
    assert all(r["ms"] is None and r["error"] == "RuntimeError: boom" for r in bad)
    # --append keeps what is there
    again = bench.RowFile(out, append=True)
    again.add(dict(on_disk[0], case="c"))
    assert [r["case"] for r in json.loads(out.read_text())] == ["a", "a", "a", "a", "b", "b", "c"]


def test_time_budget_stops_cleanly(tmp_path):
    """Once the next row would not fit in the budget the rest is skipped and reported, not measured."""
    clock = FakeClock()
    timed = []

    def timer(step, device, grad_to_none=None):
        timed.append(1)
        clock.now += 10.0
        return 1.0

    plan = [(bench.Case(f"c{i}", 1, 16, 1, 1, 8, 8), ("fwd",)) for i in range(5)]
    rows = bench.RowFile(tmp_path / "rows.json")
    budget = bench.Budget(25.0, clock=clock)
    summary = bench.run_bench(SPEC, plan, {"gdngen": fake_impl}, rows, device="cpu", dtype=torch.float32,
                              budget=budget, timer=timer, progress=bench.Progress(5, clock=clock))
    # rows take 10 s: at 0 and 10 s a row fits, at 20 s the next (20 + 10 > 25) does not
    assert len(timed) == 2 and [r["case"] for r in rows.rows] == ["c0", "c1"]
    assert summary["skipped"] == ["fwd gdngen c2", "fwd gdngen c3", "fwd gdngen c4"]
    assert json.loads((tmp_path / "rows.json").read_text()) == rows.rows


def test_plot_writes_a_png_per_mode_and_impl(tmp_path):
    rows = []
    for impl, speed in (("gdngen", 1.0), ("fla", 0.6), ("sdpa", 0.8)):
        for mode in bench.MODES:
            for T in (2048, 8192, 32768):
                rows.append({"op": "chunk_gated_delta_rule", "mode": mode, "impl": impl, "B": 1, "T": T, "H": 16,
                             "HV": 32, "K": 128, "V": 128, "dtype": "bfloat16", "ms": T / 1e4 / speed,
                             "peak_mib": 10.0})
    rows.append(dict(rows[0], impl="flashqla", ms=None, error="failed"))     # unmeasured: not drawn
    path = bench.write_plot(rows, tmp_path / "p.png", title="synthetic")
    width, height, pixels = read_png(path)
    assert (width, height) == (2 * 520, 420)                                  # one panel per mode
    for impl in ("gdngen", "fla", "sdpa"):
        assert count_colour(pixels, bench.IMPL_COLOURS[impl]) > 200          # lines and markers drawn
    assert count_colour(pixels, bench.IMPL_COLOURS["flashqla"]) == 0
    left = [r[: 3 * 520] for r in pixels]
    assert count_colour(left, bench.IMPL_COLOURS["gdngen"]) > 100            # fwd panel has data
    with pytest.raises(ValueError, match="rows: no measured row"):
        bench.write_plot([rows[-1]], tmp_path / "none.png")


def test_cli_plot_from_rows_file(tmp_path, capsys):
    rows = [{"op": "x", "mode": "fwd", "impl": "gdngen", "B": 1, "T": t, "H": 1, "HV": 1, "K": 8, "V": 8,
             "dtype": "float32", "ms": 1.0, "peak_mib": None} for t in (64, 128)]
    src = tmp_path / "r.json"
    src.write_text(json.dumps(rows))
    assert main(["bench", "--plot", str(src)]) == 0
    assert read_png(tmp_path / "r.png")[:2] == (520, 420)


def test_cli_bench_end_to_end_on_the_interpreter(tmp_path, capsys):
    """The real CLI: one tiny case, forward only, the generated kernel under the Triton interpreter."""
    out = tmp_path / "cpu.json"
    assert main(["bench", "--skip-check", "--impls", "gdngen", "--modes", "fwd", "--cases", "1,40,1,2,16,16",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 1 and SCHEMA <= set(rows[0]) and rows[0]["ms"] > 0 and "error" not in rows[0]
    assert (rows[0]["B"], rows[0]["T"], rows[0]["HV"], rows[0]["K"]) == (1, 40, 2, 16)
    assert out.with_suffix(".png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--cases", "1,2,3"], "--cases: expected B,T,H,HV"),
    (["--cases", "nope"], "--cases: 'nope' is neither"),
    (["--modes", "bwd"], "--modes: expected a comma-separated subset"),
    (["--impls", "gdngen,xla"], "--impls: expected a comma-separated subset"),
])
def test_cli_bench_rejects_bad_options(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_default_out_path_names_the_device(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    path = bench.default_out_path("NVIDIA H200", tmp_path)
    assert path.parent == tmp_path / "benchmarks" / "results"
    assert path.name.startswith("h200_") and path.suffix == ".json"


def test_roofline_floor_per_mode():
    """One floor model for forward and forward+backward rows (the benchmark scripts call it too)."""
    import pytest
    from gdngen.bench import Case, floor_ms
    case = Case("c", 1, 32768, 32, 32)
    forward, training = floor_ms(case), floor_ms(case, "fwd+bwd")
    assert 0 < forward < training <= 3 * forward + 1e-9
    with pytest.raises(ValueError, match="mode"):
        floor_ms(case, "bwd")


def test_clock_log_reads_nvidia_smi_lines():
    assert bench.ClockLog.parse("1980, 0x0000000000000004") == (1980.0, 4)
    assert bench.ClockLog.parse("1545, 0x0000000000000000\n") == (1545.0, 0)
    for junk in ("clocks.current.sm [MHz], clocks_event_reasons.active", "[N/A], 0x0", "", "No devices were found"):
        assert bench.ClockLog.parse(junk) is None


def test_clock_log_samples_a_process_beside_the_benchmark():
    """A stand-in for nvidia-smi printing two samples (and a line to skip) is read while the log is open."""
    script = "import time\nprint('header')\nprint('1980, 0x0', flush=True)\nprint('1695, 0x4', flush=True)\ntime.sleep(30)"
    with bench.ClockLog(command=[sys.executable, "-c", script]) as clocks:
        deadline = time.monotonic() + 20
        while len(clocks.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert clocks.process.poll() is not None                    # stopped on exit, not left running
    assert [s[1:] for s in clocks.samples] == [(1980.0, 0), (1695.0, 4)]
    assert clocks.window(0.0, time.monotonic()) == {"sm_mhz": 1837.5, "sm_mhz_min": 1695.0, "power_capped": 0.5}
    assert bench.ClockLog(command=[]).__enter__().window(0.0, 1e9) == {}     # nothing to sample: no fields


def test_rows_carry_the_clock_they_were_timed_at(tmp_path):
    clock = FakeClock()
    clocks = bench.ClockLog(command=[], clock=clock)
    # samples before, during and after the two timed rows (each timed over 1 s of the fake clock)
    clocks.samples = [(0.5, 1980.0, 0), (1.5, 1980.0, 0), (1.7, 1710.0, 4), (2.2, 1500.0, 4), (3.5, 1965.0, 0)]

    def timer(step, device, grad_to_none=None):
        clock.now += 1.0
        return 1.0

    plan = [(bench.Case(f"c{i}", 1, 16, 1, 1, 8, 8), ("fwd",)) for i in range(2)]
    rows = bench.RowFile(tmp_path / "rows.json")
    clock.now = 1.0
    bench.run_bench(SPEC, plan, {"gdngen": fake_impl}, rows, device="cpu", dtype=torch.float32,
                    budget=bench.Budget(None, clock=clock), timer=timer, progress=bench.Progress(2, clock=clock),
                    clocks=clocks)
    first, second = rows.rows
    assert (first["sm_mhz"], first["sm_mhz_min"], first["power_capped"]) == (1845.0, 1710.0, 0.5)   # 1.0-2.0 s
    assert (second["sm_mhz"], second["sm_mhz_min"], second["power_capped"]) == (1500.0, 1500.0, 1.0)  # 2.0-3.0 s
    table = bench.format_table(rows.rows)
    assert "SM 1845 MHz (min 1710); power-capped 50%" in table and "SM 1500 MHz (min 1500); power-capped 100%" in table


def test_the_table_gives_each_peer_as_a_multiple_of_gdngen_and_the_floor_reached():
    shape = dict(B=1, T=32768, H=32, HV=32, K=128, V=128)
    rows = [dict(mode="fwd", impl="gdngen", ms=0.5, floor_ms=0.25, **shape),
            dict(mode="fwd", impl="flashqla", ms=0.65, floor_ms=0.25, **shape),
            dict(mode="fwd+bwd", impl="flashqla", ms=2.8, **shape),                 # no gdngen row of its mode
            dict(mode="fwd", impl="fla", ms=None, error="RuntimeError: out of memory", **shape)]
    lines = bench.format_table(rows).splitlines()[1:]
    assert "floor 0.250 ms (50% of it)" in lines[0] and "gdngen's time" not in lines[0]
    assert "1.30x gdngen's time; floor 0.250 ms (38% of it)" in lines[1]
    assert "gdngen's time" not in lines[2] and "floor" not in lines[2]
    assert "out of memory" in lines[3]
