"""benchmarks/stress_gpu.py --plot on synthetic rows (no GPU, no kernels): the PNG of the long and sweeps
sections drawn by gdngen.plot's line panels, and the figures printed for docs/reliability.md."""
import importlib.util
import json
import struct
import sys
import zlib

import pytest
import torch

from gdngen import plot
from gdngen.render import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("stress_gpu", ROOT / "benchmarks" / "stress_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_pixels(path):
    """(width, height, set of RGB colours) of an 8-bit RGB PNG written by gdngen.plot.Canvas."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, colour_type = struct.unpack(">IIBB", data[16:26])
    assert (depth, colour_type) == (8, 2)
    idat = b"".join(data[pos + 8:pos + 8 + n] for pos, n in _chunks(data) if data[pos + 4:pos + 8] == b"IDAT")
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    colours = {raw[y * stride + 1 + x:y * stride + 4 + x] for y in range(height) for x in range(0, 3 * width, 3)}
    return width, height, colours


def _chunks(data):
    pos = 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        yield pos, n
        pos += 12 + n


def synthetic_rows():
    rows = [{"section": "env", "case": "environment", "device": "test", "ok": True}]
    for dtype, err in (("bfloat16", 3.5e-3), ("float32", 3.3e-7)):
        for i, T in enumerate((4096, 8192, 16384)):
            rows.append({"section": "long", "case": f"T={T}", "dtype": dtype, "T": T, "H": 4, "HV": 4,
                         "rel_rmse_o": err * (1 + 0.01 * i), "rel_rmse_ht": err * 0.8,
                         "rel_rmse_o_last_tokens": err, "tol": 5e-3 if dtype == "bfloat16" else 1e-5, "ok": True})
    for head in (0, 7):
        rows.append({"section": "long", "case": f"B*T*H*K = 2^31, head {head}", "dtype": "bfloat16",
                     "shape": [1, 2097152, 8, 128], "elements": 2 ** 31, "rel_rmse_o": 3.4e-3, "rel_rmse_ht": 2.6e-3,
                     "rel_rmse_o_last_tokens": 3.4e-3, "rel_diff_vs_head_alone": 4.6e-5, "ht_diff_vs_head_alone": 0.0,
                     "tol": 5e-3, "ok": True})
    rows.append({"section": "long", "case": "section time", "seconds": 1.0, "ok": True})
    for mode, rate in (("fwd", 1e7), ("fwd+bwd", 2e6)):
        # tokens/s 0.25, 0.5, 1, 0.8 (a 20% drop from T=512 to T=1024) times rate; peak MiB linear in T
        for T, f in ((128, 0.25), (256, 0.5), (512, 1.0), (1024, 0.8)):
            rows.append({"section": "sweeps", "case": "T sweep", "mode": mode, "B": 1, "T": T, "H": 16, "HV": 32,
                         "dtype": "bfloat16", "ms": T / (rate * f) * 1e3, "tokens_per_s": rate * f,
                         "peak_mib": T * (0.035 if mode == "fwd" else 0.095), "ok": True})
        rows.append({"section": "sweeps", "case": "T sweep", "mode": mode, "T": 2048,
                     "error": "OutOfMemoryError('CUDA out of memory.')", "oom": True, "ok": True})
        for B in (1, 2, 4):
            rows.append({"section": "sweeps", "case": "B sweep", "mode": mode, "B": B, "T": 4096, "H": 16, "HV": 32,
                         "dtype": "bfloat16", "ms": 1.0, "tokens_per_s": rate * (1 + B / 10),
                         "peak_mib": 145.0 * B, "ok": True})
    return rows


def test_plot_mode_writes_the_png_and_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # the built-in rasteriser, whatever is installed
    stress = load_script()
    src = tmp_path / "stress.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows()))
    out = tmp_path / "plots" / "s.png"
    out.parent.mkdir()
    assert stress.main(["--plot", str(src), "--png", str(out)]) == 0
    width, height, colours = png_pixels(out)
    assert width == 2 * 560 and height > 2 * 360                 # 2 x 2 panels
    for colour in (plot._PALETTE[0], plot._PALETTE[1], plot._PALETTE[2], plot._PALETTE[3], plot._PALETTE[4]):
        assert bytes(colour) in colours                          # fwd, fwd+bwd, bf16, fp32, the 2^31 case
    text = capsys.readouterr().out
    assert "| 4,096 | 3.500e-03 | 2.800e-03 | 3.300e-07 | 2.640e-07 |" in text
    assert "head 7 bfloat16 [1, 2097152, 8, 128]: o 3.400e-03" in text
    assert "T sweep fwd: 4 points, T 128..1,024" in text
    assert "largest drop 20.0% (T 512 -> 1,024), peak MiB slope 1.0000" in text
    assert "out of memory at T 2,048" in text
    assert "B sweep fwd+bwd: 3 points, B 1..4" in text and "largest drop none" in text
    assert f"plot: {out}" in text
    assert not torch.cuda.is_initialized()

    # default PNG path: the jsonl's, with .png
    assert stress.main(["--plot", str(src)]) == 0
    assert src.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_mode_without_long_or_sweeps_rows_draws_nothing(tmp_path, capsys):
    stress = load_script()
    src = tmp_path / "numerics.jsonl"
    src.write_text(json.dumps({"section": "numerics", "case": "beta = 0", "rel_rmse_o": 0.0, "ok": True}) + "\n")
    assert stress.main(["--plot", str(src)]) == 0
    assert not src.with_suffix(".png").exists()
    assert "plot:" not in capsys.readouterr().out


def test_sweep_figures_slope_and_drop():
    stress = load_script()
    figures = {(f["sweep"], f["mode"]): f for f in stress.sweep_figures(synthetic_rows())}
    t = figures[("T sweep", "fwd")]
    assert t["peak_mib_slope"] == pytest.approx(1.0)
    assert t["largest_drop"] == (512, 1024, pytest.approx(0.8)) and t["oom_at"] == 2048
    b = figures[("B sweep", "fwd+bwd")]
    assert b["largest_drop"] is None and b["oom_at"] is None and b["peak_mib_slope"] == pytest.approx(1.0)


def test_line_panels_canvas_log_axes_and_empty(tmp_path):
    panels = [plot.Panel("log-log", [plot.Series("a", [(1, 1e-3), (1024, 1e2)], plot._PALETTE[5]),
                                      plot.Series("b", [(2, 5.0)], plot._PALETTE[6], dashed=True, join=False)],
                          xlabel="t", xlog2=True, ylog=True),
              plot.Panel("empty", [plot.Series("none", [])])]
    path = plot.draw_line_panels(panels, tmp_path / "p.png")
    width, _, colours = png_pixels(path)
    assert width == 560                                          # the empty panel is left out
    assert bytes(plot._PALETTE[5]) in colours and bytes(plot._PALETTE[6]) in colours
    with pytest.raises(ValueError):
        plot.draw_line_panels([panels[1]], tmp_path / "q.png")
