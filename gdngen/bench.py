"""Side-by-side benchmark behind ``gdngen bench``: gdngen vs FLA vs FlashQLA vs PyTorch SDPA.

For every (case, mode, implementation) one row is measured — first call (compile included), peak
memory of one step (peak allocated minus allocated before the step, inputs already allocated),
then the median of ``triton.testing.do_bench`` after its warm-up — and the whole row list is
rewritten to a JSON file after each row, so a run killed half-way keeps what it measured.  A PNG of
tokens/s against T per implementation is drawn from the rows by a small built-in rasteriser
(:func:`write_plot` on :mod:`gdngen.plot`; zlib only, no matplotlib).

Row schema: ``{op, mode, impl, B, T, H, HV, K, V, dtype, ms, peak_mib}`` plus ``case``,
``device``, ``tokens_per_s``, ``first_call_s``, ``floor_ms`` (GDN on an H200: the roofline floor of its mode) or ``error``;
on a GPU with ``nvidia-smi``, ``sm_mhz`` / ``sm_mhz_min`` / ``power_capped``: the SM clock while the row was timed
(median, lowest) and the share of samples with the power cap holding it down (:class:`ClockLog`).
Failed rows carry ``error`` and ``ms: null``.  On CPU (Triton interpreter) the timings only show
that the code runs; peak memory is ``null`` there.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gdngen.plot import _PALETTE, Canvas, _nice_step, _pow2, _si

MODES = ("fwd", "fwd+bwd")
ALL_IMPLS = ("gdngen", "fla", "flashqla", "sdpa")
# The issue #10 cases (B, T, H, HV), K = V = 128.  fwd+bwd runs on the first three.
ISSUE_CASES = {
    "b1-t32k-h32": (1, 32768, 32, 32),
    "b4-t8k-h16-hv32": (4, 8192, 16, 32),
    "b8-t2k-h16": (8, 2048, 16, 16),
    "b1-t128k-h16-hv32": (1, 131072, 16, 32),
    "b1-t32k-h2-hv8": (1, 32768, 2, 8),
}
ISSUE_FWD_BWD = ("b1-t32k-h32", "b4-t8k-h16-hv32", "b8-t2k-h16")
SDPA_MAX_T = 65536          # flash attention is quadratic in T: seconds per call beyond this
HBM_BYTES_PER_S = 4.27e12   # H200 roofline constants (benchmarks/NOTES.md)
BF16_FLOPS = 790e12


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    T: int
    H: int
    HV: int
    K: int = 128
    V: int = 128


def parse_cases(text: Optional[str], device: str) -> list[tuple[Case, tuple[str, ...]]]:
    """``--cases`` into ``[(case, modes it runs in)]``; modes are filtered by ``--modes`` later.

    ``None``/``issue``: the issue's cases (fwd on five, fwd+bwd on three); ``sweep``: T from 2k to
    128k at B=1, H=16, HV=32; otherwise a comma-free list of names from :data:`ISSUE_CASES` or
    ``B,T,H,HV[,K,V]`` tuples separated by spaces or ``;``.  On CPU the default is one tiny case.
    """
    if text is None and device == "cpu":
        return [(Case("tiny", 1, 64, 1, 2, 16, 16), MODES)]
    if text is None or text == "issue":
        return [(Case(name, *shape), MODES if name in ISSUE_FWD_BWD else ("fwd",))
                for name, shape in ISSUE_CASES.items()]
    if text == "sweep":
        return [(Case(f"b1-t{t // 1024}k-h16-hv32", 1, t, 16, 32), MODES) for t in (2048 * 2 ** i for i in range(7))]
    out = []
    for item in re.split(r"[;\s]+", text.strip()):
        if not item:
            continue
        if item in ISSUE_CASES:
            out.append((Case(item, *ISSUE_CASES[item]), MODES))
            continue
        try:
            dims = [int(x) for x in item.split(",")]
        except ValueError:
            raise ValueError(f"--cases: {item!r} is neither a case name ({', '.join(ISSUE_CASES)}, issue, sweep) "
                             f"nor B,T,H,HV[,K,V]") from None
        if len(dims) not in (4, 6) or min(dims) < 1:
            raise ValueError(f"--cases: expected B,T,H,HV or B,T,H,HV,K,V of positive integers, got {item!r}")
        out.append((Case(item, *dims), MODES))
    if not out:
        raise ValueError("--cases: no case given")
    return out


def parse_list(text: Optional[str], allowed: tuple[str, ...], option: str) -> list[str]:
    if text is None:
        return list(allowed)
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise ValueError(f"{option}: expected a comma-separated subset of {list(allowed)}, got {text!r}")
    return names


# =============================================================================================
# Inputs and implementations
# =============================================================================================

def make_inputs(spec, case: Case, dtype, device: str, *, seed: int = 0, requires_grad: bool = False) -> dict:
    """Random inputs of realistic magnitude drawn on the device (host-side float64 would take
    seconds at T=131072): q, k (L2-normalised for the delta rule), v, g = logsigmoid(randn + 2),
    beta = sigmoid(randn); g and beta in float32."""
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    k = randn(B, T, H, K)
    if spec.transition.delta:
        k = F.normalize(k, dim=-1)
    inputs = {"q": randn(B, T, H, K).to(dtype), "k": k.to(dtype), "v": randn(B, T, HV, V).to(dtype)}
    if spec.transition.decay == "scalar":
        inputs["g"] = F.logsigmoid(randn(B, T, HV) + 2.0)
    elif spec.transition.decay == "vector":
        inputs["g"] = F.logsigmoid(randn(B, T, HV, K) + 3.0) / 4
    if spec.transition.delta:
        inputs["beta"] = torch.sigmoid(randn(B, T, HV))
    if requires_grad:
        for x in inputs.values():
            x.requires_grad_(True)
    return inputs


def _sdpa(inputs: dict):
    """Causal softmax attention on the same q/k/v (q/k heads repeated to the value heads)."""
    import torch
    import torch.nn.functional as F
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    rep = v.shape[2] // q.shape[2]
    qq = q.repeat_interleave(rep, 2).transpose(1, 2)
    kk = k.repeat_interleave(rep, 2).transpose(1, 2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(qq, kk, v.transpose(1, 2), is_causal=True)


@dataclass(frozen=True)
class FlaPeer:
    """How FLA 0.6.0's op of a spec's name is called on :func:`make_inputs`'s inputs (one row per spec).

    ``args`` are input names passed positionally in FLA's parameter order; ``kwargs`` are fixed keyword
    arguments (set to what gdngen's op does by default); ``gva``: FLA accepts ``HV`` a multiple of ``H``
    (otherwise FLA's op asserts or mis-broadcasts, so a case with ``H != HV`` fails its row with a clear
    error instead); ``env``: environment set before the import (backend switches).
    """
    module: str
    function: str
    args: tuple[str, ...]
    kwargs: tuple[tuple[str, object], ...] = ()
    gva: bool = False
    env: tuple[tuple[str, str], ...] = ()


# Every catalogue spec beside FLA's op of the same name.  Input conventions match make_inputs without
# conversion: g is the per-token log-decay ([B, T, HV] scalar, [B, T, HV, K] per key channel; FLA does
# the chunk cumsum), beta post-sigmoid, no in-kernel l2norm / gate / beta-sigmoid (gdngen's defaults),
# scale K ** -0.5 on both sides.  linear_attn: both ops default to normalize=True (passed explicitly).
FLA_PEERS: dict[str, FlaPeer] = {
    "linear_attn": FlaPeer("fla.ops.linear_attn", "chunk_linear_attn", ("q", "k", "v"), (("normalize", True),)),
    "simple_gla": FlaPeer("fla.ops.simple_gla", "chunk_simple_gla", ("q", "k", "v", "g")),
    "gla": FlaPeer("fla.ops.gla", "chunk_gla", ("q", "k", "v", "g")),
    "delta_rule": FlaPeer("fla.ops.delta_rule", "chunk_delta_rule", ("q", "k", "v", "beta")),
    # FLA_FLASH_QLA=0: time FLA's own Triton path, not its FlashQLA dispatch (FlashQLA is its own row)
    "gated_delta_rule": FlaPeer("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", ("q", "k", "v", "g", "beta"),
                                gva=True, env=(("FLA_FLASH_QLA", "0"),)),
    # FLA's default dispatch otherwise (FlashKDA needs the in-kernel gate, so it never takes these calls)
    "kda": FlaPeer("fla.ops.kda", "chunk_kda", ("q", "k", "v", "g", "beta"), gva=True),
}
GDN_ONLY_PEERS = ("flashqla", "sdpa")


def fla_peer(spec_name: str, log=print) -> Optional[Callable]:
    """``inputs -> o`` calling FLA's op named like the spec (:data:`FLA_PEERS`); None (logged) when FLA or
    the op cannot be imported or the spec has no FLA counterpart."""
    import importlib
    peer = FLA_PEERS.get(spec_name)
    if peer is None:
        log(f"fla unavailable: no FLA op registered for {spec_name} in gdngen.bench.FLA_PEERS")
        return None
    for key, value in peer.env:
        os.environ[key] = value
    try:
        fn = getattr(importlib.import_module(peer.module), peer.function)
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        log(f"fla unavailable: {exc!r}"[:300])
        return None
    kwargs = dict(peer.kwargs)

    def call(inputs: dict):
        if not peer.gva:
            H, HV = inputs["q"].shape[2], inputs["v"].shape[2]
            if H != HV:
                raise ValueError(f"FLA's {peer.function} takes H == HV only (got H={H}, HV={HV})")
        return fn(*[inputs[n] for n in peer.args], **kwargs)[0]

    call.__name__ = f"fla_{peer.function}"
    return call


def load_impls(names: list[str], spec, module, device: str, log=print) -> dict[str, Callable]:
    """Callables ``inputs -> o`` for the available implementations; a missing peer is logged, not fatal.

    ``fla`` is FLA's op of the spec's name for every catalogue spec (:data:`FLA_PEERS`); FlashQLA and
    SDPA are offered for ``gated_delta_rule`` only.
    """
    impls: dict[str, Callable] = {}
    chunk_fn = getattr(module, spec.chunk_function)
    if "gdngen" in names:
        impls["gdngen"] = lambda inputs: chunk_fn(**inputs)[0]
    if "fla" in names:
        fn = fla_peer(spec.name, log=log)
        if fn is not None:
            impls["fla"] = fn
    gdn_only = [n for n in names if n in GDN_ONLY_PEERS]
    if gdn_only and spec.name != "gated_delta_rule":
        log(f"peers {gdn_only} skipped: they implement gated_delta_rule, not {spec.name}")
        return impls
    gdn = FLA_PEERS["gated_delta_rule"].args
    if "flashqla" in names:
        try:
            from flash_qla import chunk_gated_delta_rule as flash_qla
            impls["flashqla"] = lambda inputs: flash_qla(*[inputs[n] for n in gdn])[0]
        except Exception as exc:  # noqa: BLE001
            log(f"flashqla unavailable: {exc!r}"[:300])
    if "sdpa" in names:
        if device == "cuda":
            impls["sdpa"] = _sdpa
        else:
            log("sdpa unavailable: the flash backend needs CUDA")
    return impls


def floor_ms(case: Case, mode: str = "fwd") -> float:
    """H200 roofline floor of the GDN chunk op, bf16: every input, output and gradient crosses HBM once
    (forward: q, k, v, g, beta in, o out; ``fwd+bwd`` adds q, k, v, g, beta, do in and dq, dk, dv, dg,
    dbeta out); matmul FLOPs of the chunkwise forward, 3x that for forward+backward."""
    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode: expected 'fwd' or 'fwd+bwd', got {mode!r}")
    C, B, T, H, HV, K, V = 64, case.B, case.T, case.H, case.HV, case.K, case.V
    forward_bytes = 2 * H * K * 2 + HV * V * 2 * 2 + HV * 4 * 2
    backward_bytes = (2 * H * K * 2 + 2 * HV * V * 2 + HV * 4 * 2) + (2 * H * K * 2 + HV * V * 2 + HV * 4 * 2)
    per_token = forward_bytes + (backward_bytes if mode == "fwd+bwd" else 0)
    # per chunk and value head: KK^T, QK^T (2C^2K each), W,U (C^2(K+V)), WS, QS, K^T V (3 CKV), (QK^T)V (C^2V)
    flops = B * HV * (T / C) * 2 * (2 * C * C * K + C * C * (K + V) + 3 * C * K * V + C * C * V)
    flops *= 3 if mode == "fwd+bwd" else 1
    return max(B * T * per_token / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e3


# =============================================================================================
# Measurement
# =============================================================================================

def measure_ms(step: Callable, device: str, grad_to_none=None) -> float:
    """Median ms of ``step``: ``triton.testing.do_bench`` (its own warm-up) on CUDA, wall clock on CPU."""
    if device == "cuda":
        import triton
        return triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if grad_to_none:
            for x in grad_to_none:
                x.grad = None
    return statistics.median(times) * 1e3


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


class ClockLog:
    """The GPU's SM clock and throttle reasons, sampled every ``period_ms`` by ``nvidia-smi`` (read only: it sets
    nothing) in a process beside the benchmark, so a row can say what clock it was timed at.

    Why: called back to back, the (1,131072,16,32) forward draws the H100's 700 W limit; its clock then falls to
    1.55-1.75 GHz of 1.98 and do_bench reads 2.03 ms against 1.95 of kernels timed in a short burst
    (benchmarks/NOTES.md, stop 61). Two rows timed at different clocks are not comparable.
    ``gpu``: the card, as ``nvidia-smi -i`` names it (:func:`gpu_id`); without it (CPU, CI) or without
    ``nvidia-smi`` it samples nothing and :meth:`window` gives ``{}``. ``command``: another sampler (tests).
    """
    POWER_CAP = 0x4      # clocks_throttle_reasons.active: the software power cap

    def __init__(self, gpu: Optional[str] = None, period_ms: int = 50, clock=time.monotonic, command=None):
        self.clock = clock
        self.samples: list[tuple[float, float, int]] = []      # (clock(), SM MHz, throttle reasons)
        self.command = command
        if command is None and gpu is not None and shutil.which("nvidia-smi"):
            self.command = ["nvidia-smi", "--query-gpu=clocks.sm,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits", f"--loop-ms={period_ms}", "-i", gpu]
        self.process = self.reader = None

    @staticmethod
    def parse(line: str) -> Optional[tuple[float, int]]:
        """``"1980, 0x0000000000000004"`` -> (1980.0, 4); None for anything else (a header, an error line)."""
        parts = [p.strip() for p in line.split(",")]
        try:
            return float(parts[0]), int(parts[1], 16)
        except (IndexError, ValueError):
            return None

    def __enter__(self) -> "ClockLog":
        if self.command:
            try:
                self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                text=True)
            except OSError:
                return self
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            sample = self.parse(line)
            if sample is not None:
                self.samples.append((self.clock(), *sample))

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.reader.join(timeout=5)

    def window(self, start: float, end: float) -> dict:
        """The row fields for the samples taken between ``start`` and ``end`` (``clock()`` times); ``{}`` if none."""
        inside = [(mhz, reasons) for t, mhz, reasons in self.samples if start <= t <= end]
        if not inside:
            return {}
        mhz = [m for m, _ in inside]
        return {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz),
                "power_capped": sum(1 for _, r in inside if r & self.POWER_CAP) / len(inside)}


def gpu_id() -> str:
    """The current CUDA device as ``nvidia-smi -i`` names it: its UUID where torch gives one
    (CUDA_VISIBLE_DEVICES renumbers indices), else its index."""
    import torch
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid else str(index)


def measure_row(fn: Callable, inputs: dict, mode: str, device: str, timer=measure_ms,
                clocks: Optional[ClockLog] = None) -> dict:
    """First call, peak memory of one step and the median time of ``fn`` in ``mode``; with ``clocks``, the SM clock
    while it was timed (:meth:`ClockLog.window`)."""
    import torch
    leaves = [x for x in inputs.values() if mode == "fwd+bwd" and x.requires_grad]
    if mode == "fwd+bwd":
        probe = fn(inputs)
        do = torch.randn_like(probe)
        del probe

        def step():
            fn(inputs).backward(do)
    else:
        def step():
            with torch.no_grad():
                fn(inputs)

    def clear():
        for x in leaves:
            x.grad = None

    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    clear()
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        clear()
    started = clocks.clock() if clocks is not None else None
    ms = timer(step, device, grad_to_none=leaves or None)
    clear()
    row = {"ms": ms, "peak_mib": peak, "first_call_s": first}
    if clocks is not None:
        row.update(clocks.window(started, clocks.clock()))
    return row


class Progress:
    """A one-line progress bar on stderr: done/total, elapsed seconds and the current row."""

    def __init__(self, total: int, stream=None, clock=time.monotonic):
        self.total, self.stream, self.clock = total, stream or sys.stderr, clock
        self.start = clock()

    def show(self, done: int, label: str) -> None:
        width = 24
        filled = int(width * done / max(self.total, 1))
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                          f"{self.clock() - self.start:6.0f}s {label[:56]:<56}")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


class RowFile:
    """The row list as a JSON file, rewritten whole (temp file + rename) after every row."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.rows: list[dict] = []
        if append and self.path.exists():
            self.rows = json.loads(self.path.read_text())
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.rows, indent=1) + "\n")
        os.replace(tmp, self.path)


class Budget:
    """Wall-clock budget: a row starts only if the time left covers what the same kind of row took."""

    def __init__(self, seconds: Optional[float], clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.start = clock()
        self.last_cost: dict[tuple, float] = {}

    def elapsed(self) -> float:
        return self.clock() - self.start

    def allows(self, key: tuple) -> bool:
        if self.seconds is None:
            return True
        return self.elapsed() + self.last_cost.get(key, 0.0) <= self.seconds

    def record(self, key: tuple, seconds: float) -> None:
        self.last_cost[key] = seconds


def default_out_path(device_name: str, root: Path) -> Path:
    """``benchmarks/results/<device-slug>_<date>.json``, e.g. ``h200_2026-11-30.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower().replace("nvidia", "")).strip("-") or "device"
    folder = root / "benchmarks" / "results"
    return (folder if folder.is_dir() else Path.cwd()) / f"{slug}_{time.strftime('%Y-%m-%d')}.json"


def run_bench(spec, plan: list[tuple[Case, tuple[str, ...]]], impls: dict[str, Callable], rows: RowFile, *,
              device: str, dtype, budget: Budget, timer=measure_ms, progress: Optional[Progress] = None,
              device_name: str = "cpu", log=print, clocks: Optional[ClockLog] = None) -> dict:
    """Measure every (case, mode, impl) of ``plan`` in order, appending a row after each (with ``clocks``, each
    timed row also gets the SM clock it ran at).

    Returns ``{"measured": n, "failed": n, "skipped": [labels skipped for the time budget]}``.
    """
    import torch
    work = [(case, mode, name) for case, modes in plan for mode in modes for name in impls]
    progress = progress or Progress(len(work))
    dtype_name = str(dtype).replace("torch.", "")
    summary = {"measured": 0, "failed": 0, "skipped": []}
    done = 0
    inputs, inputs_for = None, None
    for case, mode, name in work:
        label = f"{mode} {name} {case.name}"
        progress.show(done, label)
        key = (mode, name)
        if not budget.allows(key):
            summary["skipped"].append(label)
            done += 1
            continue
        row = {"op": spec.chunk_function, "mode": mode, "impl": name, "B": case.B, "T": case.T, "H": case.H,
               "HV": case.HV, "K": case.K, "V": case.V, "dtype": dtype_name, "ms": None, "peak_mib": None,
               "case": case.name, "device": device_name}
        started = budget.clock()
        if name == "sdpa" and case.T > SDPA_MAX_T:
            row["error"] = f"not run: softmax attention is quadratic in T; skipped above T={SDPA_MAX_T}"
        else:
            try:
                if inputs_for != (case, mode):
                    inputs = inputs_for = None
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    inputs = make_inputs(spec, case, dtype, device, requires_grad=mode == "fwd+bwd")
                    inputs_for = (case, mode)
                row.update(measure_row(impls[name], inputs, mode, device, timer=timer, clocks=clocks))
                row["tokens_per_s"] = case.B * case.T / row["ms"] * 1e3
                if spec.name == "gated_delta_rule" and "H200" in device_name:
                    row["floor_ms"] = floor_ms(case, mode)
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the run
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                if device == "cuda":
                    torch.cuda.empty_cache()
        budget.record(key, budget.clock() - started)
        rows.add(row)
        summary["failed" if row.get("error") else "measured"] += 1
        done += 1
    progress.show(done, "done")
    return summary


def format_table(rows: list[dict]) -> str:
    """The rows as a text table. Its notes give each peer's time as a multiple of gdngen's at the same mode and
    shape, the share of the roofline floor a row reaches (floor / ms, where the floor is known), the SM clock and
    any power cap."""
    lines = [f"{'mode':<8} {'impl':<9} {'case (B,T,H,HV,K,V)':<28} {'ms':>9} {'Mtok/s':>9} {'peak MiB':>9} "
             f"{'first s':>8}  note"]
    def key(r):
        return r["mode"], r["B"], r["T"], r["H"], r["HV"], r["K"], r["V"]
    ours = {key(r): r["ms"] for r in rows if r["impl"] == "gdngen" and r.get("ms")}
    for r in rows:
        shape = f"{r['B']},{r['T']},{r['H']},{r['HV']},{r['K']},{r['V']}"
        mine = ours.get(key(r))
        ms = f"{r['ms']:9.3f}" if r.get("ms") is not None else f"{'-':>9}"
        tps = f"{r['tokens_per_s'] / 1e6:9.2f}" if r.get("tokens_per_s") else f"{'-':>9}"
        peak = f"{r['peak_mib']:9.0f}" if r.get("peak_mib") is not None else f"{'-':>9}"
        first = f"{r['first_call_s']:8.2f}" if r.get("first_call_s") is not None else f"{'-':>8}"
        note = r.get("error", "")[:60] or "; ".join(
            ([f"{r['ms'] / mine:.2f}x gdngen's time"] if mine and r["impl"] != "gdngen" and r.get("ms") else [])
            + ([f"floor {r['floor_ms']:.3f} ms ({r['floor_ms'] / r['ms']:.0%} of it)"]
               if r.get("floor_ms") and r.get("ms") else [])
            + ([f"SM {r['sm_mhz']:.0f} MHz (min {r['sm_mhz_min']:.0f})"] if r.get("sm_mhz") else [])
            + ([f"power-capped {r['power_capped']:.0%}"] if r.get("power_capped") else []))
        lines.append(f"{r['mode']:<8} {r['impl']:<9} {shape:<28} {ms} {tps} {peak} {first}  {note}")
    return "\n".join(lines)


# =============================================================================================
# PNG of the rows (the rasteriser and line panels live in gdngen.plot)
# =============================================================================================

IMPL_COLOURS = {"gdngen": _PALETTE[0], "fla": _PALETTE[1], "flashqla": _PALETTE[2], "sdpa": _PALETTE[3]}


def write_plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """A PNG of tokens/s against T (log2 axis), one panel per mode, one colour per implementation.

    Points of the same implementation and shape family (B, H, HV, K, V) are joined by a line; every
    measured row is a square marker.  Rows without ``ms`` are left out.
    """
    import math
    good = [r for r in rows if r.get("ms")]
    modes = [m for m in MODES if any(r["mode"] == m for r in good)] + \
        sorted({r["mode"] for r in good} - set(MODES))
    if not modes:
        raise ValueError(f"rows: no measured row to plot (of {len(rows)})")
    impls = list(dict.fromkeys(r["impl"] for r in good))
    colours = {name: IMPL_COLOURS.get(name, _PALETTE[(4 + i) % len(_PALETTE)]) for i, name in enumerate(impls)}
    panel_w, panel_h, left, right, top, bottom = 520, 380, 80, 30, 50, 60
    canvas = Canvas(panel_w * len(modes), panel_h + 40)
    if title:
        canvas.text(10, 8, title, scale=2)
    legend_x = canvas.width - sum(Canvas.text_width(n) + 30 for n in impls) - 10
    for name in impls:
        canvas.rect(legend_x, 14, legend_x + 14, 20, colours[name])
        legend_x = canvas.text(legend_x + 20, 10, name) + 10
    for p, mode in enumerate(modes):
        mine = [r for r in good if r["mode"] == mode]
        x0, y0 = p * panel_w + left, 40 + top                   # plot area corners
        x1, y1 = (p + 1) * panel_w - right, 40 + panel_h - bottom
        ts = [math.log2(r["T"]) for r in mine]
        tmin, tmax = min(ts), max(ts)
        if tmax - tmin < 1:
            tmin, tmax = tmin - 0.5, tmax + 0.5
        ymax = max(r["B"] * r["T"] / r["ms"] * 1e3 for r in mine) * 1.1
        step = _nice_step(ymax)

        def px(r):
            tps = r["B"] * r["T"] / r["ms"] * 1e3
            return (round(x0 + (math.log2(r["T"]) - tmin) / (tmax - tmin) * (x1 - x0)),
                    round(y1 - tps / ymax * (y1 - y0)))

        grey = (200, 200, 200)
        tick = 0.0
        while tick <= ymax:
            y = round(y1 - tick / ymax * (y1 - y0))
            canvas.line(x0, y, x1, y, grey)
            label = _si(tick)
            canvas.text(x0 - 6 - Canvas.text_width(label), y - 5, label)
            tick += step
        for e in range(math.ceil(tmin), math.floor(tmax) + 1):
            x = round(x0 + (e - tmin) / (tmax - tmin) * (x1 - x0))
            canvas.line(x, y0, x, y1, grey)
            label = _pow2(2 ** e)
            canvas.text(x - Canvas.text_width(label) // 2, y1 + 8, label)
        canvas.line(x0, y0, x0, y1, (0, 0, 0))
        canvas.line(x0, y1, x1, y1, (0, 0, 0))
        canvas.text(x0, y0 - 22, f"{mode}: tokens/s")
        canvas.text((x0 + x1) // 2 - Canvas.text_width("t (log2)") // 2, y1 + 30, "t (log2)")
        for name in impls:
            families: dict[tuple, list[dict]] = {}
            for r in mine:
                if r["impl"] == name:
                    families.setdefault((r["B"], r["H"], r["HV"], r["K"], r["V"]), []).append(r)
            for family in families.values():
                points = [px(r) for r in sorted(family, key=lambda r: r["T"])]
                for a, b in zip(points, points[1:]):
                    canvas.line(*a, *b, colours[name], thick=2)
                for x, y in points:
                    canvas.rect(x - 3, y - 3, x + 3, y + 3, colours[name])
    path = Path(path)
    path.write_bytes(canvas.png())
    return path
