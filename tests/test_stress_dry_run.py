"""benchmarks/stress_gpu.py --dry-run: two sections at toy sizes on CPU (Triton interpreter) end to end."""
import importlib.util
import json

from gdngen.render import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("stress_gpu", ROOT / "benchmarks" / "stress_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_long_and_soak(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    stress = load_script()
    assert stress.main(["--dry-run", "--sections", "long,soak", "--soak-seconds", "1.5"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "stress.jsonl").read_text().splitlines()]
    assert all(r["ok"] for r in rows)
    long_rows = [r for r in rows if r["section"] == "long" and "rel_rmse_o" in r]
    # three doubling T points, then the many-element case on its first and last head
    assert [r.get("T") for r in long_rows[:3]] == [64, 128, 256]
    assert [r["case"].split(", ")[-1] for r in long_rows[3:]] == ["head 0", "head 3"]
    for r in long_rows:
        assert r["rel_rmse_o"] <= 1e-5 and r["rel_rmse_ht"] <= 1e-5
    for r in long_rows[3:]:
        assert r["rel_diff_vs_head_alone"] <= 1e-5 and r["elements"] == 1 * 512 * 4 * 16
    soak = [r for r in rows if r["section"] == "soak"]
    cases = [r for r in soak if "rel_rmse_o" in r]
    assert cases and all(r["rel_rmse_o"] <= r["tol"] for r in cases)
    final = next(r for r in soak if r["case"] == "memory_allocated flat over the soak")
    assert final["cases"] == len(cases) and final["failures"] == 0
    assert "| long |" in capsys.readouterr().out          # the summary table is printed last


def test_dry_run_zero_budget_skips_cleanly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    stress = load_script()
    assert stress.main(["--dry-run", "--sections", "long", "--budget", "0"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "stress.jsonl").read_text().splitlines()]
    long_rows = [r for r in rows if r["section"] == "long" and r["case"] != "section time"]
    assert long_rows and all(r.get("skipped") == "time budget" for r in long_rows)
