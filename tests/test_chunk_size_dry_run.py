"""benchmarks/chunk_size_study.py --dry-run: the GPU code path at toy sizes on CPU (Triton interpreter), the table,
the PNG, re-plotting from the jsonl, and the time budget."""
import importlib.util
import json

from gdngen.render import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("chunk_size_study", ROOT / "benchmarks" / "chunk_size_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dry_run_grid_table_plot_and_replot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    study = load_script()
    assert study.main(["--dry-run"]) == 0
    rows = rows_of(tmp_path / "chunk_size.jsonl")
    assert rows[0]["kind"] == "meta" and rows[0]["grid"]["chunk_sizes"] == [16, 32, 64]
    times = [r for r in rows if r["kind"] == "time"]
    # every head dim x chunk size x length class, forward only, all measured
    assert sorted((r["K"], r["BT"], r["class"]) for r in times) == sorted(
        (K, BT, cls) for K in (16, 32) for BT in (16, 32, 64) for cls in ("short", "long"))
    assert all(r["mode"] == "fwd" and r["ms"] > 0 and "error" not in r for r in times)
    errors = [r for r in rows if r["kind"] == "error"]
    assert len(errors) == 2 * 3 * 2                      # once per (K, chunk size), for both classes' paths
    assert all(r["rel_l2_o"] <= 1e-5 and r["rel_l2_ht"] <= 1e-5 for r in errors)   # fp32 under the interpreter
    assert rows[-1]["kind"] == "total"

    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| 16 | short") or line.startswith("| 32 | long")]
    assert len(table) >= 2
    for line in table[:2]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[6] in ("16", "32", "64")              # winner column
    assert "winner" in out and "err o @64" in out
    png = tmp_path / "chunk_size.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # re-plot from the jsonl alone (results copied into benchmarks/results/)
    replot = tmp_path / "again.png"
    assert study.main(["--plot", str(tmp_path / "chunk_size.jsonl"), "--png", str(replot)]) == 0
    again = capsys.readouterr().out
    assert replot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [line for line in again.splitlines() if line.startswith("| ")] == \
        [line for line in out.splitlines() if line.startswith("| ")]


def test_dry_run_backward(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    study = load_script()
    assert study.main(["--dry-run", "--quick", "--backward", "--chunk-sizes", "32,64"]) == 0
    rows = rows_of(tmp_path / "chunk_size.jsonl")
    both = [r for r in rows if r["kind"] == "time" and r["mode"] == "fwd+bwd"]
    assert sorted((r["BT"], r["class"]) for r in both) == [(32, "long"), (32, "short"), (64, "long"), (64, "short")]
    assert all(r["K"] == 16 and r["ms"] > 0 for r in both)
    grads = [r for r in rows if r["kind"] == "grad_error"]
    assert [r["BT"] for r in grads] == [32, 64]
    assert all(max(r["rel_l2"].values()) <= 1e-5 for r in grads)
    assert "### fwd+bwd" in capsys.readouterr().out


def test_dry_run_zero_budget_skips_cleanly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    study = load_script()
    assert study.main(["--dry-run", "--quick", "--budget", "0"]) == 0
    rows = rows_of(tmp_path / "chunk_size.jsonl")
    skipped = [r for r in rows if r["kind"] == "skipped"]
    assert [r["BT"] for r in skipped] == [16, 32, 64]
    assert not [r for r in rows if r["kind"] in ("time", "error")]
    assert "skipped for the time budget" in capsys.readouterr().out
    assert not (tmp_path / "chunk_size.png").exists()      # nothing measured, nothing to plot
