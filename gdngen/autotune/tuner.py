"""``tune``: pick each stage's launch config per shape class by checking, then timing, candidates.

For every shape and chunk size the tuner runs the spec's generated chunk function with all stages
pinned by :func:`gdngen.runtime.override`: first at the defaults (the baseline outputs), then one
stage at a time through its pruned candidates, the other stages at their best so far (coordinate
descent in launch order: wy, state, output). Each candidate's outputs - ``o`` and the final state,
with every freshly allocated tensor poisoned with NaN - are compared with the baseline *before* it
is timed; a candidate that is wrong or raises is recorded as rejected and never chosen (some
configs miscompile under Triton 3.6 on Hopper: benchmarks/NOTES.md). Winners go to the per-device
cache (``gdngen.autotune.cache``); the chunk size that gave the fastest total is recorded as advice.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from gdngen.autotune import cache as _cache
from gdngen.autotune import space as _space
from gdngen.autotune.device import DeviceInfo, current_device
from gdngen.runtime.tiles import default_tiles, override, record_stages
from gdngen.selfcheck import make_inputs, poisoned_memory, rel_rmse

# rel. RMSE against the default config's outputs (and 8x that for the worst element relative to
# the largest): different accumulation orders stay far inside, a miscompile is O(1) off.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
INTERPRETER_DEVICE = DeviceInfo("triton-interpreter", (0, 0), sm_count=1, smem_per_block=227 * 1024)


class TuningAborted(RuntimeError):
    """The device is unusable after a candidate (e.g. an illegal address): finished winners were saved."""


@dataclass(frozen=True)
class ShapeCase:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def parse(cls, text: str, dtype: torch.dtype = torch.bfloat16) -> "ShapeCase":
        """``"B,T,H,HV,K,V"``."""
        try:
            B, T, H, HV, K, V = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"shapes: expected B,T,H,HV,K,V (six integers), got {text!r}") from None
        return cls(B, T, H, HV, K, V, dtype)

    @property
    def label(self) -> str:
        return f"{self.B},{self.T},{self.H},{self.HV},{self.K},{self.V} {_cache.dtype_name(self.dtype)}"


@dataclass
class Candidate:
    stage: str
    BT: int
    config: dict
    is_default: bool = False
    ms: Optional[float] = None
    rejected: Optional[str] = None

    @property
    def label(self) -> str:
        return f"{self.stage} BT={self.BT} " + " ".join(f"{k}={v}" for k, v in self.config.items())


@dataclass
class StageResult:
    shape: ShapeCase
    BT: int
    stage: str
    key: str
    winner: Candidate
    default: Candidate
    candidates: list = field(default_factory=list)

    @property
    def rejected(self) -> list:
        return [c for c in self.candidates if c.rejected]


@dataclass
class TuneReport:
    results: list = field(default_factory=list)          # StageResult per (shape, BT, stage)
    chunk_totals: dict = field(default_factory=dict)      # (shape, BT) -> best total ms
    chunk_winners: dict = field(default_factory=dict)     # shape -> best BT
    cache_path: Optional[str] = None


def _wall_timer(fn: Callable, candidate: Candidate, reps: int = 3) -> float:
    """Median wall-clock ms (the interpreter's smoke mode: says only that it runs)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _bench_timer(fn: Callable, candidate: Candidate) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def default_timer(on_gpu: bool) -> Callable:
    return _bench_timer if on_gpu else _wall_timer


@contextlib.contextmanager
def _pinned(spec_name: str, configs: dict):
    with contextlib.ExitStack() as stack:
        for stage, config in configs.items():
            stack.enter_context(override(spec_name, stage, **config))
        yield


def check_outputs(got, want, dtype: torch.dtype, tol: Optional[float] = None) -> Optional[str]:
    """None when ``got`` matches the baseline ``want`` (o, final state), else why not."""
    tol = TOLERANCE.get(dtype, 1e-2) if tol is None else tol
    for name, a, e in zip(("o", "final_state"), got, want):
        if a is None or e is None:
            if a is not e:
                return f"{name} missing"
            continue
        if a.shape != e.shape:
            return f"{name} shape {tuple(a.shape)} != {tuple(e.shape)}"
        err = rel_rmse(a, e)
        if not err <= tol:
            return f"{name} rel_rmse {err:.2e} > {tol:.0e}"
        worst = ((a.double() - e.double()).abs().max() / e.double().abs().max().clamp_min(1e-30)).item()
        if not worst <= 8 * tol:
            return f"{name} max error {worst:.2e} of max|ref| > {8 * tol:.0e}"
    return None


def _fatal(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("illegal memory access", "illegal address", "unspecified launch failure",
                                   "device-side assert", "cuda error: an illegal"))


def _progress_fn(progress):
    if progress is True:
        from gdngen.cli import _progress
        return _progress
    if callable(progress):
        return progress
    return lambda i, n, label: None


def tune(spec, shapes: Iterable, *, module=None, timer: Optional[Callable] = None,
         stages: Optional[Iterable[str]] = None, chunk_sizes: Optional[Iterable[int]] = None,
         device: Optional[DeviceInfo] = None, cache_dir=None, max_candidates: Optional[int] = None,
         tol: Optional[float] = None, min_gain: float = 0.01, progress=False, write: bool = True,
         seed: int = 0, runner: Optional[Callable] = None) -> TuneReport:
    """Tune ``spec``'s generated chunk forward for ``shapes`` and write the winners to the cache.

    Args:
        spec: the Spec (its generated module is ``generated.<name>`` unless ``module`` is given).
        shapes: ShapeCase objects, or ``(B, T, H, HV, K, V)`` tuples (bf16 on a GPU, fp32 otherwise).
        timer: ``timer(fn, candidate) -> ms``; default ``triton.testing.do_bench`` median on CUDA,
            wall-clock median under the interpreter.
        stages: subset of the stages the spec launches (default all: wy, state, output).
        chunk_sizes: subset of ``spec.chunk.sizes`` (default all of them).
        device: the DeviceInfo the cache is written for (default: the current GPU; without one,
            a stand-in "triton-interpreter" device - smoke testing only).
        max_candidates: cap per stage, default included (the candidates nearest the default).
        tol: rel. RMSE tolerance of the check against the default config (default per dtype).
        min_gain: a candidate must beat the default by this fraction to replace it (timing noise).
        progress: True for a bar on stderr, or a ``(i, n, label)`` callable.
        write: write winners to the cache (``cache_dir`` or $GDNGEN_CACHE_DIR or ~/.cache/gdngen).
        runner: ``runner(inputs, BT) -> (o, final_state)``; default calls the generated function.
    """
    if module is None:
        module = importlib.import_module(f"generated.{spec.name}")
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    device = device or current_device() or INTERPRETER_DEVICE
    timer = timer or default_timer(on_gpu)
    tick = _progress_fn(progress)
    dev = "cuda" if torch.cuda.is_available() and on_gpu else "cpu"
    chunk_list = list(chunk_sizes) if chunk_sizes else _space.chunk_sizes(spec)
    bad = [c for c in chunk_list if c not in spec.chunk.sizes]
    if bad:
        raise ValueError(f"chunk_sizes: {bad} not among spec.chunk.sizes {list(spec.chunk.sizes)}")
    wanted = list(stages) if stages else list(_space.STAGES)
    unknown = [s for s in wanted if s not in _space.STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {unknown}, expected some of {list(_space.STAGES)}")
    cases = [s if isinstance(s, ShapeCase) else
             ShapeCase(*s, dtype=torch.bfloat16 if dev == "cuda" else torch.float32) for s in shapes]
    fn = getattr(module, spec.chunk_function)

    def default_run(inputs, BT):
        return fn(**inputs, output_final_state=True, chunk_size=BT)

    run = runner or default_run
    report = TuneReport()
    entries: dict[str, dict] = {}

    # a rough count for the progress bar: candidates per stage are only known per shape
    plan = []
    for case in cases:
        for BT in chunk_list:
            plan.append((case, BT))
    total, counter = 0, [0]
    per_stage_counts = {}
    for case, BT in plan:
        sizes = dict(K=case.K, V=case.V, BT=BT, N=case.B, HV=case.HV, dtype=case.dtype)
        for stage in [s for s in _space.stages_for(spec) if s in wanted]:
            cands = _space.candidates(stage, K=case.K, V=case.V, BT=BT, dtype=case.dtype,
                                      default=default_tiles(stage, **sizes), device=device, limit=max_candidates)
            per_stage_counts[(case, BT, stage)] = cands
            total += len(cands)

    def step(label):
        counter[0] += 1
        tick(min(counter[0], total), max(total, 1), label)

    try:
        for case in cases:
            inputs = make_inputs(spec, B=case.B, T=case.T, H=case.H, HV=case.HV, K=case.K, V=case.V,
                                 dtype=case.dtype, device=dev, seed=seed)
            for BT in chunk_list:
                sizes = dict(K=case.K, V=case.V, BT=BT, N=case.B, HV=case.HV, dtype=case.dtype)
                with record_stages() as seen:
                    with poisoned_memory():
                        baseline_configs = {s: default_tiles(s, **sizes) for s in _space.STAGES}
                        with _pinned(spec.name, baseline_configs):
                            reference = run(inputs, BT)
                launched = [s for s in _space.STAGES if s in seen]
                current = {s: default_tiles(s, **sizes) for s in launched}
                best_total = None
                for stage in [s for s in launched if s in wanted]:
                    configs = per_stage_counts.get((case, BT, stage)) or _space.candidates(
                        stage, K=case.K, V=case.V, BT=BT, dtype=case.dtype, default=default_tiles(stage, **sizes),
                        device=device, limit=max_candidates)
                    result = _tune_stage(spec, case, BT, stage, configs, current, run, inputs, reference,
                                         timer, tol, device, step, min_gain)
                    current[stage] = dict(result.winner.config)
                    best_total = result.winner.ms
                    report.results.append(result)
                    entries[result.key] = _cache.make_entry(
                        result.winner.config, spec_hash=spec.hash, ms=round(result.winner.ms, 6),
                        default_ms=round(result.default.ms, 6), candidates=len(result.candidates),
                        rejected=len(result.rejected), shape=case.label)
                if best_total is not None:
                    report.chunk_totals[(case, BT)] = best_total
            totals = {BT: report.chunk_totals[(case, BT)] for BT in chunk_list if (case, BT) in report.chunk_totals}
            if totals:
                best_bt = min(totals, key=totals.get)
                report.chunk_winners[case] = best_bt
                key = _cache.entry_key(spec.name, "chunk", _cache.shape_class(
                    H=case.H, HV=case.HV, K=case.K, V=case.V, dtype=case.dtype, BT=0, N=case.B, T=case.T,
                    sm_count=device.sm_count))
                entries[key] = _cache.make_entry({"chunk_size": best_bt}, spec_hash=spec.hash,
                                                 ms=round(totals[best_bt], 6),
                                                 chunk_ms={str(b): round(t, 6) for b, t in totals.items()},
                                                 shape=case.label)
    finally:
        if progress:
            tick(max(total, 1), max(total, 1), "done")
        if write and entries:
            report.cache_path = str(_cache.write_entries(device, entries, directory=cache_dir))
    return report


def _tune_stage(spec, case: ShapeCase, BT: int, stage: str, configs: list, current: dict, run, inputs, reference,
                timer, tol, device: DeviceInfo, tick, min_gain: float = 0.0) -> StageResult:
    tried = []
    for i, config in enumerate(configs):
        cand = Candidate(stage, BT, dict(config), is_default=(i == 0))
        tick(f"{case.label} {cand.label}")
        pinned = dict(current)
        pinned[stage] = cand.config

        def call():
            with _pinned(spec.name, pinned):
                return run(inputs, BT)

        try:
            with poisoned_memory():
                got = call()
            cand.rejected = check_outputs(got, reference, case.dtype, tol)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is data
            if _fatal(exc):
                raise TuningAborted(f"{cand.label} left the device unusable ({exc}); rerun without it "
                                    "(add it to gdngen.autotune.space.KNOWN_BAD)") from exc
            cand.rejected = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        if cand.rejected is None:
            try:
                cand.ms = float(timer(call, cand))
            except Exception as exc:  # noqa: BLE001
                if _fatal(exc):
                    raise TuningAborted(f"{cand.label} left the device unusable ({exc})") from exc
                cand.rejected = f"timing raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        tried.append(cand)
    default = tried[0]
    survivors = [c for c in tried if c.rejected is None]
    if default.rejected is not None:
        # the baseline itself cannot fail its own check unless it is nondeterministic or crashed
        raise RuntimeError(f"{default.label}: the default config failed ({default.rejected}); not tuning {stage}")
    winner = min(survivors, key=lambda c: c.ms)
    if winner.ms > default.ms * (1.0 - min_gain):
        winner = default          # within timing noise of the default: keep the proven config
    key = _cache.entry_key(spec.name, stage, _cache.shape_class(
        H=case.H, HV=case.HV, K=case.K, V=case.V, dtype=case.dtype, BT=BT, N=case.B, T=case.T,
        sm_count=device.sm_count))
    return StageResult(case, BT, stage, key, winner, default, tried)


def format_report(report: TuneReport) -> str:
    """A table of winners against the default config, then the chunk-size advice."""
    lines = [f"{'shape (B,T,H,HV,K,V dtype)':<30} {'BT':>3} {'stage':<7} {'winner':<34} {'ms':>9} "
             f"{'default ms':>10} {'speedup':>7} {'tried':>5} {'rejected':>8}"]
    for r in report.results:
        cfg = " ".join(f"{k}={v}" for k, v in r.winner.config.items())
        lines.append(f"{r.shape.label:<30} {r.BT:>3} {r.stage:<7} {cfg:<34} {r.winner.ms:>9.3f} "
                     f"{r.default.ms:>10.3f} {r.default.ms / r.winner.ms:>6.2f}x {len(r.candidates):>5} "
                     f"{len(r.rejected):>8}")
        for c in r.rejected:
            lines.append(f"{'':<30} rejected {c.label}: {c.rejected}")
    for case, bt in report.chunk_winners.items():
        totals = ", ".join(f"BT={b}: {t:.3f} ms" for (c, b), t in report.chunk_totals.items() if c == case)
        first = next((r for r in report.results if r.shape == case), None)
        base = f"; all defaults at BT={first.BT}: {first.default.ms:.3f} ms" if first else ""
        lines.append(f"chunk size for {case.label}: {bt} (tuned totals {totals}{base})")
    return "\n".join(lines)


__all__ = ["Candidate", "ShapeCase", "StageResult", "TuneReport", "TuningAborted", "check_outputs",
           "format_report", "tune"]
