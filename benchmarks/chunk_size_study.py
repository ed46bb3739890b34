"""Chunk-size study of the generated Gated DeltaNet chunk op (issue #5): which chunk size wins on speed
per head dim and sequence-length class, and what each costs in error against float64.

Grid: head dims K = V in {64, 128, 256}; a short class (B, T) = (8, 2048) and a long class (1, 16384)
(B*T about the same); H = HV = 16; bf16; every chunk size the spec allows (16, 32, 64).  Per
(K, chunk size), in order:

* error: relative L2 (||a - e|| / ||e||) of o and of the final state against ``gdngen.reference`` in
  float64 (chunked form, same chunk size) at T = 4096, once with B = 2 and once with B = 1: the op
  picks its kernel path from N*HV (``store_wu``: W/U in memory when N*HV < 32), so B=2 takes the
  short class's path and B=1 the long class's (each row records ``store_wu``);
* time: per class, the first call (compile included), then the median of triton.testing.do_bench
  (warm-up first, return_mode="median") of the forward, and with ``--backward`` of forward+backward
  (with gradient errors vs autograd through the float64 reference at B=1, T=4096).

Every row is appended to $OUT/chunk_size.jsonl as soon as it is measured (a run killed at a time limit
keeps what it wrote); a markdown table (winner per (K, class), ms and error per chunk size) is printed
last and $OUT/chunk_size.png drawn (matplotlib when importable, else gdngen.plot's built-in PNG
rasteriser): time relative to the default chunk size and error, each against chunk size, a line per
head dim (solid: short class, dashed: long class).  ``--budget`` seconds: a (K, chunk size) group
starts only if the time left covers what the previous group took; the rest are logged as skipped.

    python benchmarks/chunk_size_study.py [--quick] [--backward] [--head-dims 64,128] [--budget 540]
    python benchmarks/chunk_size_study.py --plot benchmarks/results/FILE.jsonl [--png OUT.png]  # re-plot
    python benchmarks/chunk_size_study.py --dry-run   # CPU, Triton interpreter, toy sizes (a few seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch                                    # noqa: E402
import torch.nn.functional as F                 # noqa: E402

from gdngen import reference                    # noqa: E402
from gdngen.selfcheck import rel_rmse           # noqa: E402
from gdngen.spec import load_spec               # noqa: E402

SPEC = load_spec(ROOT / "specs" / "gated_delta_rule.yaml")
GRAD_NAMES = ("q", "k", "v", "g", "beta")


class Grid:
    """The sizes of one run: GPU full, GPU quick, or the CPU dry run (Triton interpreter, fp32)."""

    def __init__(self, dry: bool, quick: bool, head_dims=None, chunk_sizes=None):
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        # bf16 is not available under the interpreter: the dry run uses fp32
        self.dtype = torch.float32 if dry else torch.bfloat16
        if dry:
            self.head_dims = [16] if quick else [16, 32]
            self.classes = {"short": (2, 32), "long": (1, 64)}
            self.H = 1
            self.err_T = 64
        else:
            self.head_dims = [128] if quick else [64, 128, 256]
            self.classes = {"short": (8, 2048), "long": (1, 16384)}
            self.H = 16
            self.err_T = 4096
        if head_dims:
            self.head_dims = list(head_dims)
        self.chunk_sizes = list(chunk_sizes) if chunk_sizes else list(SPEC.chunk.sizes)
        bad = [c for c in self.chunk_sizes if c not in SPEC.chunk.sizes]
        if bad:
            raise ValueError(f"--chunk-sizes: the spec allows {list(SPEC.chunk.sizes)}, got {bad}")
        # error inputs: B=2 mirrors the short class's kernel path, B=1 the long class's (store_wu on N*HV)
        self.err_B = {"short": 2, "long": 1}

    def describe(self) -> dict:
        return {"head_dims": self.head_dims, "classes": self.classes, "H": self.H, "HV": self.H,
                "chunk_sizes": self.chunk_sizes, "err_T": self.err_T, "dtype": dname(self.dtype)}


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def store_wu_path(N: int, HV: int) -> bool:
    from gdngen.runtime.tiles import store_wu
    return bool(store_wu(SPEC.name, N=N, HV=HV))


class Log:
    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, row: dict) -> dict:
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row


class Progress:
    """tqdm when importable, else one line per row: [done/total elapsed] label."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def step(self, label: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_description(label[:60])
            self.bar.update(n)
        else:
            print(f"[{self.done}/{self.total} {time.monotonic() - self.start:5.0f}s] {label}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def op():
    from generated.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def make_inputs(grid: Grid, B: int, T: int, K: int, seed: int = 0):
    """bench_prefill's inputs at head dim K: L2-normalised k, g = logsigmoid(randn + 2), beta = sigmoid(randn);
    g and beta float32."""
    gen = torch.Generator(device=grid.device).manual_seed(seed)
    H = HV = grid.H

    def randn(*shape):
        return torch.randn(*shape, device=grid.device, generator=gen)

    q = randn(B, T, H, K).to(grid.dtype)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(grid.dtype)
    v = randn(B, T, HV, K).to(grid.dtype)
    g = F.logsigmoid(randn(B, T, HV) + 2.0)
    beta = torch.sigmoid(randn(B, T, HV))
    return [q, k, v, g, beta]


def sync(grid: Grid) -> None:
    if grid.device == "cuda":
        torch.cuda.synchronize()


def median_ms(grid: Grid, step, leaves=None) -> float:
    """GPU: triton.testing.do_bench median (its own warm-up); dry run: wall-clock median of a few calls."""
    if grid.device == "cuda":
        import triton
        return triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    step()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_errors(grid: Grid, log: Log, K: int, BT: int) -> None:
    """rel-L2 of o and the final state vs float64 at err_T, for the short class's path (B=2) and the long's (B=1):
    one float64 reference at B=2; the B=1 run is batch row 0 (rows are independent)."""
    B = max(grid.err_B.values())
    x = make_inputs(grid, B, grid.err_T, K, seed=1)
    with torch.no_grad():
        o_ref, ht_ref = reference.run(SPEC, *x, form="chunked", chunk_size=BT, output_final_state=True)
        for cls, b in grid.err_B.items():
            part = [t[:b] for t in x]
            o, ht = op()(*part, chunk_size=BT, output_final_state=True)
            log({"kind": "error", "K": K, "V": K, "BT": BT, "class": cls, "B": b, "T": grid.err_T, "H": grid.H,
                 "HV": grid.H, "dtype": dname(grid.dtype), "store_wu": store_wu_path(b, grid.H),
                 "rel_l2_o": rel_rmse(o, o_ref[:b]), "rel_l2_ht": rel_rmse(ht, ht_ref[:b])})
    del x, o_ref, ht_ref


def measure_grad_errors(grid: Grid, log: Log, K: int, BT: int) -> None:
    """rel-L2 of every input gradient vs autograd through the float64 reference, B=1 at err_T."""
    x = [t.requires_grad_(True) for t in make_inputs(grid, 1, grid.err_T, K, seed=2)]
    gen = torch.Generator(device=grid.device).manual_seed(3)
    do = torch.randn(x[2].shape, device=grid.device, generator=gen).to(grid.dtype)
    o, _ = op()(*x, chunk_size=BT)
    got = torch.autograd.grad(o, x, do)
    ref = [t.detach().double().requires_grad_(True) for t in x]
    ro, _ = reference.run(SPEC, *ref, form="chunked", chunk_size=BT)
    want = torch.autograd.grad(ro, ref, do.double())
    log({"kind": "grad_error", "K": K, "V": K, "BT": BT, "B": 1, "T": grid.err_T, "H": grid.H, "HV": grid.H,
         "dtype": dname(grid.dtype), "rel_l2": {n: rel_rmse(a, b) for n, a, b in zip(GRAD_NAMES, got, want)}})


def measure_time(grid: Grid, log: Log, K: int, BT: int, cls: str, mode: str, device_name: str) -> None:
    B, T = grid.classes[cls]
    row = {"kind": "time", "mode": mode, "K": K, "V": K, "BT": BT, "class": cls, "B": B, "T": T, "H": grid.H,
           "HV": grid.H, "dtype": dname(grid.dtype), "store_wu": store_wu_path(B, grid.H), "device": device_name}
    fn = op()
    try:
        x = make_inputs(grid, B, T, K)
        leaves = None
        if mode == "fwd":
            def step():
                with torch.no_grad():
                    fn(*x, chunk_size=BT)
        else:
            leaves = [t.requires_grad_(True) for t in x]
            gen = torch.Generator(device=grid.device).manual_seed(4)
            do = torch.randn(x[2].shape, device=grid.device, generator=gen).to(grid.dtype)

            def step():
                fn(*leaves, chunk_size=BT)[0].backward(do)

        def clear():
            for t in leaves or ():
                t.grad = None

        sync(grid)
        start = time.perf_counter()
        step()
        sync(grid)
        row["first_call_s"] = time.perf_counter() - start
        clear()
        if grid.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            clear()
        row["ms"] = median_ms(grid, step, leaves)
        row["tokens_per_s"] = B * T / row["ms"] * 1e3
        clear()
    except Exception as exc:  # noqa: BLE001 - one failing config (e.g. out of shared memory) must not end the run
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    finally:
        x = leaves = None
        if grid.device == "cuda":
            torch.cuda.empty_cache()
    log(row)


# =============================================================================================
# Table and plot: from rows (this run's, or a committed jsonl)
# =============================================================================================

def _index(rows: list[dict]):
    """Latest row per key (concatenated runs: a later row replaces an earlier one)."""
    times, errors, grads = {}, {}, {}
    for r in rows:
        if r.get("kind") == "time":
            times[(r["mode"], r["K"], r["class"], r["BT"])] = r
        elif r.get("kind") == "error":
            errors[(r["K"], r["class"], r["BT"])] = r
        elif r.get("kind") == "grad_error":
            grads[(r["K"], r["BT"])] = r
    return times, errors, grads


def _fmt_err(x) -> str:
    return "-" if x is None else f"{x:.3e}"


def _winner(ms_by_bt: dict):
    good = {bt: ms for bt, ms in ms_by_bt.items() if ms}
    if not good:
        return None, None
    order = sorted(good, key=good.get)
    margin = (good[order[1]] / good[order[0]] - 1) if len(order) > 1 else None
    return order[0], margin


def format_table(rows: list[dict]) -> str:
    times, errors, grads = _index(rows)
    sizes = sorted({k[-1] for k in times} | {k[-1] for k in errors} | {k[-1] for k in grads})
    default = SPEC.chunk.default if SPEC.chunk.default in sizes else (sizes[-1] if sizes else None)
    lines = []
    meta = [r for r in rows if r.get("kind") == "meta"]
    for m in meta:
        lines.append(f"device: {m.get('device')} (torch {m.get('torch')}, triton {m.get('triton')}), "
                     f"dtype {m.get('grid', {}).get('dtype')}, H=HV={m.get('grid', {}).get('H')}")
    classes = ["short", "long"] + sorted({k[2] for k in times} - {"short", "long"})
    head_dims = sorted({k[1] for k in times} | {k[0] for k in errors})
    modes = [m for m in ("fwd", "fwd+bwd") if any(k[0] == m for k in times)]
    for mode in modes:
        lines.append("")
        lines.append(f"### {mode}: median ms per chunk size, winner, rel-L2 of o vs float64 per chunk size")
        lines.append("")
        head = (["K=V", "class (B,T)", "path"] + [f"ms @{c}" for c in sizes] + ["winner", "margin to 2nd",
                f"winner vs {default}"] + [f"err o @{c}" for c in sizes])
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for K in head_dims:
            for cls in classes:
                mine = {c: times.get((mode, K, cls, c)) for c in sizes}
                if not any(mine.values()):
                    continue
                any_row = next(r for r in mine.values() if r)
                ms = {c: (r or {}).get("ms") for c, r in mine.items()}
                best, margin = _winner(ms)
                cells = [str(K), f"{cls} ({any_row['B']},{any_row['T']})",
                         "W/U" if any_row.get("store_wu") else "T"]
                for c in sizes:
                    r = mine[c]
                    cells.append("-" if r is None else ("fail" if r.get("error") else f"{r['ms']:.3f}"))
                cells.append(str(best) if best else "-")
                cells.append(f"{100 * margin:.1f}%" if margin is not None else "-")
                cells.append(f"{ms[default] / ms[best]:.2f}x" if best and ms.get(default) else "-")
                cells += [_fmt_err((errors.get((K, cls, c)) or {}).get("rel_l2_o")) for c in sizes]
                lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines.append("")
        lines.append("### rel-L2 vs float64 at the error shape (o / final state), per chunk size")
        lines.append("")
        head = ["K=V", "path (B,T)"] + [f"o @{c}" for c in sizes] + [f"ht @{c}" for c in sizes]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for K in head_dims:
            for cls in classes:
                mine = {c: errors.get((K, cls, c)) for c in sizes}
                if not any(mine.values()):
                    continue
                any_row = next(r for r in mine.values() if r)
                cells = [str(K), f"{'W/U' if any_row.get('store_wu') else 'T'} ({any_row['B']},{any_row['T']})"]
                cells += [_fmt_err((mine[c] or {}).get("rel_l2_o")) for c in sizes]
                cells += [_fmt_err((mine[c] or {}).get("rel_l2_ht")) for c in sizes]
                lines.append("| " + " | ".join(cells) + " |")
    if grads:
        lines.append("")
        lines.append("### gradients: rel-L2 vs autograd through float64, per chunk size (q, k, v, g, beta)")
        lines.append("")
        head = ["K=V", "T"] + [f"@{c}" for c in sizes]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for K in head_dims:
            mine = {c: grads.get((K, c)) for c in sizes}
            if not any(mine.values()):
                continue
            T = next(r for r in mine.values() if r)["T"]
            cells = [str(K), str(T)]
            for c in sizes:
                r = mine[c]
                cells.append("-" if r is None else " / ".join(f"{r['rel_l2'][n]:.1e}" for n in GRAD_NAMES))
            lines.append("| " + " | ".join(cells) + " |")
    for r in times.values():
        if r.get("error"):
            lines.append(f"failed: {r['mode']} K={r['K']} BT={r['BT']} {r['class']}: {r['error'][:160]}")
    for r in rows:
        if r.get("kind") == "failed":
            lines.append(f"failed: {r['stage']} K={r['K']} BT={r['BT']}: {r['error'][:160]}")
    skipped = ["K=%s BT=%s" % (r["K"], r["BT"]) for r in rows if r.get("kind") == "skipped"]
    if skipped:
        lines.append("skipped for the time budget: " + ", ".join(skipped))
    return "\n".join(lines)


def _series(rows: list[dict]):
    """Per panel: {(K, cls): [(BT, y), ...]}; time relative to the default chunk size, error absolute."""
    times, errors, _ = _index(rows)
    sizes = sorted({k[-1] for k in times} | {k[-1] for k in errors})
    default = SPEC.chunk.default if SPEC.chunk.default in sizes else (sizes[-1] if sizes else None)
    panels = []
    for mode in ("fwd", "fwd+bwd"):
        lines = {}
        for (m, K, cls, BT), r in sorted(times.items(), key=lambda kv: kv[0][1:]):
            base = times.get((m, K, cls, default), {}).get("ms")
            if m == mode and r.get("ms") and base:
                lines.setdefault((K, cls), []).append((BT, r["ms"] / base))
        if lines:
            panels.append((f"{mode} time / time at chunk {default}", lines, False))
    lines = {}
    for (K, cls, BT), r in sorted(errors.items()):
        if r.get("rel_l2_o"):
            lines.setdefault((K, cls), []).append((BT, r["rel_l2_o"]))
    if lines:
        panels.append(("rel-L2 error of o vs float64", lines, True))
    return sizes, panels


def write_plot(rows: list[dict], path: Path) -> Path | None:
    """PNG of the panels (gdngen.plot.write_line_panels: matplotlib when importable, else its
    built-in rasteriser); a colour per head dim, solid: short class, dashed: long. None: nothing to plot."""
    from gdngen.plot import _PALETTE, Panel, Series, write_line_panels
    sizes, panels = _series(rows)
    if not panels:
        print("plot: no measured rows, no PNG", file=sys.stderr)
        return None
    head_dims = sorted({K for _, lines, _ in panels for K, _ in lines})
    colours = {K: _PALETTE[i % len(_PALETTE)] for i, K in enumerate(head_dims)}
    return write_line_panels(
        [Panel(title, [Series(f"K=V={K} {cls}", pts, colours[K], dashed=cls != "short")
                       for (K, cls), pts in lines.items()],
               xlabel="chunk size", xlog2=True, ylog=logy, xticks=sizes)
         for title, lines, logy in panels], Path(path))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# =============================================================================================
# Run
# =============================================================================================

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one head dim (GPU: 128; dry run: 16)")
    parser.add_argument("--backward", action="store_true", help="also forward+backward time and gradient errors")
    parser.add_argument("--head-dims", default=None, help="comma-separated K=V list (overrides the grid's)")
    parser.add_argument("--chunk-sizes", default=None, help="comma-separated subset of the spec's chunk sizes")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (default 540 on the GPU: under the device's 600 s limit)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, toy sizes: checks the script")
    parser.add_argument("--plot", metavar="FILE.jsonl", default=None,
                        help="no measuring: rebuild the table and the PNG from a jsonl of this script")
    parser.add_argument("--png", default=None, help="with --plot: PNG path (default: FILE with .png)")
    args = parser.parse_args(argv)

    if args.plot:
        rows = read_rows(Path(args.plot))
        png = write_plot(rows, Path(args.png) if args.png else Path(args.plot).with_suffix(".png"))
        print(format_table(rows))
        if png:
            print(f"\nplot: {png}")
        return 0

    if args.dry_run and not DRY:
        os.environ["TRITON_INTERPRET"] = "1"      # called in-process (tests): the caller set it before triton
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here; --dry-run checks the script on CPU")
    ints = (lambda s: [int(x) for x in s.split(",") if x.strip()])
    grid = Grid(args.dry_run, args.quick, head_dims=args.head_dims and ints(args.head_dims),
                chunk_sizes=args.chunk_sizes and ints(args.chunk_sizes))
    budget = args.budget if args.budget is not None else (None if args.dry_run else 540.0)
    out = Path(os.environ.get("OUT", "bench_out"))
    log = Log(out / "chunk_size.jsonl")

    import triton
    hw = {"triton": triton.__version__}
    if grid.device == "cuda":
        device_name = torch.cuda.get_device_name()
        hw.update(capability=list(torch.cuda.get_device_capability()),
                  sms=torch.cuda.get_device_properties(0).multi_processor_count)
    else:
        device_name = "cpu (dry run, Triton interpreter)"
    log({"kind": "meta", "device": device_name, "torch": torch.__version__, **hw, "grid": grid.describe(),
         "backward": args.backward, "budget_s": budget})

    modes = ["fwd"] + (["fwd+bwd"] if args.backward else [])
    groups = [(K, BT) for K in grid.head_dims for BT in grid.chunk_sizes]
    per_group = 1 + len(grid.classes) * len(modes) + (1 if args.backward else 0)
    progress = Progress(len(groups) * per_group)
    start, last_group_s = time.monotonic(), 0.0
    for K, BT in groups:
        if budget is not None and time.monotonic() - start + last_group_s >= budget:
            log({"kind": "skipped", "K": K, "BT": BT, "reason": "time budget"})
            progress.step(f"skipped K={K} BT={BT} (budget)", per_group)
            continue
        group_start = time.monotonic()
        label = f"K={K} BT={BT}"
        try:
            measure_errors(grid, log, K, BT)
        except Exception as exc:  # noqa: BLE001
            log({"kind": "failed", "stage": "error", "K": K, "BT": BT, "error": f"{type(exc).__name__}: {exc}"[:400]})
        e = {r["class"]: r for r in log.rows[-2:] if r.get("kind") == "error" and r.get("BT") == BT}
        progress.step(f"{label} error o " + " ".join(f"{c}={_fmt_err(r.get('rel_l2_o'))}" for c, r in e.items()))
        for mode in modes:
            for cls in grid.classes:
                measure_time(grid, log, K, BT, cls, mode, device_name)
                r = log.rows[-1]
                progress.step(f"{label} {mode} {cls} " + (f"{r['ms']:.3f} ms" if r.get("ms") else "FAILED"))
        if args.backward:
            try:
                measure_grad_errors(grid, log, K, BT)
            except Exception as exc:  # noqa: BLE001
                log({"kind": "failed", "stage": "grad_error", "K": K, "BT": BT,
                     "error": f"{type(exc).__name__}: {exc}"[:400]})
            progress.step(f"{label} gradient errors")
        last_group_s = time.monotonic() - group_start
        if grid.device == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    log({"kind": "total", "seconds": time.monotonic() - start})

    png = write_plot(log.rows, out / "chunk_size.png")
    print()
    print(format_table(log.rows))
    if png:
        print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
