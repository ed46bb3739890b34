"""``tune``: pick each stage's launch config per shape class by checking, then timing, candidates.

For every shape and chunk size the tuner runs the spec's generated chunk function with all stages
pinned by :func:`gdngen.runtime.override`: first at the defaults (the baseline outputs), then one
stage at a time through its pruned candidates, the other stages at their best so far (coordinate
descent in launch order: wy, state, output). Each candidate's outputs - ``o`` and the final state,
with every freshly allocated tensor poisoned with NaN - are compared with the baseline *before* it
is timed; a candidate that is wrong or raises is recorded as rejected and never chosen (some
configs miscompile under Triton 3.6 on Hopper: benchmarks/NOTES.md). Winners go to the per-device
cache (``gdngen.autotune.cache``); the chunk size that gave the fastest total is recorded as advice.

Backward stages (``stages`` with ``state_bwd``, ``chunk_bwd``, ... or the group word ``bwd``) are
tuned the same way after the forward ones, on a forward + backward step: fixed random cotangents
for ``o`` and the final state, ``torch.autograd.grad`` through the generated backward, the forward
stages pinned at their best so far and the backward stages pinned by
:func:`gdngen.runtime.backward_tiles.override_backward`. Every gradient (and ``o``, the final
state), NaN-poisoned fresh allocations included, is compared with the default backward config's
before the candidate is timed; the time is of the whole forward + backward step. Winners are
cached under ``<spec>/<stage>_bwd/<shape class>``, the fastest forward + backward chunk size
under ``<spec>/chunk_train/...``.
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
from gdngen.runtime.backward_tiles import default_backward_tiles, override_backward
from gdngen.runtime.tiles import default_tiles, override, record_stages
from gdngen.selfcheck import make_inputs, poisoned_memory, rel_rmse

# rel. RMSE against the default config's outputs (and 8x that for the worst element relative to
# the largest): different accumulation orders stay far inside, a miscompile is O(1) off.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
# gradients pass through more half-precision intermediates (dV_new, dW, dk completed in place) and
# the decay gradient is a difference of sums: twice the forward's room in half precision
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
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
    host_included: bool = False     # timed by do_bench: the device time could not be isolated

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
    chunk_totals: dict = field(default_factory=dict)      # (shape, BT) -> best forward total ms
    chunk_winners: dict = field(default_factory=dict)     # shape -> best forward BT
    train_totals: dict = field(default_factory=dict)      # (shape, BT) -> best forward + backward ms
    train_chunk_winners: dict = field(default_factory=dict)   # shape -> best forward + backward BT
    cache_path: Optional[str] = None


def _wall_timer(fn: Callable, candidate: Candidate, reps: int = 1) -> float:
    """Wall-clock ms (the interpreter's smoke mode: says only that it runs)."""
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


_SLEEP_CYCLES_PER_MS: list = []


def _sleep_cycles_per_ms() -> float:
    """The GPU's clock as ``torch.cuda._sleep`` counts it (cycles per ms), measured once."""
    if not _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)              # the first launch's cost is not the clock's
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS.append(cycles / max(start.elapsed_time(end), 1e-3))
    return _SLEEP_CYCLES_PER_MS[0]


def device_time_ms(fn: Callable, *, warmup: int = 5, reps: int = 20, rounds: int = 5) -> Optional[float]:
    """Device time per call of ``fn`` (ms, median of ``rounds``), with the host's time left out.

    A launch config changes the kernels, not the Python that issues them; where issuing a call takes
    longer than running it (small shapes: ~0.3-1.5 ms of host time per generated call), a timer
    that waits on the host ranks every candidate by that host time plus noise. Here the stream is
    held by a sleep kernel long enough for the host to queue ``reps`` calls behind it, so the events
    around them time the kernels back to back. The hold is checked: if the host was still queueing
    when it ended (``fn`` synchronises, or the estimate was short) it is doubled, twice at most, and
    then None says the device time could not be isolated. Calls follow each other without an L2
    flush (like a model's layers): rankings, not cold-cache figures.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    hold_ms = 1.5 * host_ms + 1.0
    times = []
    attempts = 0
    while len(times) < rounds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(hold_ms * _sleep_cycles_per_ms()))
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        held = not start.query()                     # the hold outlasted the host's queueing
        end.synchronize()
        if not held:
            attempts += 1
            if attempts > 2:
                return None
            hold_ms *= 2
            continue
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def _device_timer(fn: Callable, candidate: Candidate) -> float:
    """The tuner's GPU timer: :func:`device_time_ms`, or do_bench's median where the device time
    cannot be isolated from the host's (a call that synchronises)."""
    ms = device_time_ms(fn)
    if ms is not None:
        return ms
    candidate.host_included = True
    return _bench_timer(fn, candidate)


def default_timer(on_gpu: bool) -> Callable:
    return _device_timer if on_gpu else _wall_timer


@contextlib.contextmanager
def _pinned(spec_name: str, configs: dict):
    """Pin forward stages (``override``) and backward stages (``override_backward``) at once."""
    with contextlib.ExitStack() as stack:
        for stage, config in configs.items():
            if _space.is_backward(stage):
                stack.enter_context(override_backward(_space.runtime_stage(stage), **config))
            else:
                stack.enter_context(override(spec_name, stage, **config))
        yield


def _compare(name: str, a, e, tol: float) -> Optional[str]:
    if a is None or e is None:
        return None if a is e else f"{name} missing"
    if a.shape != e.shape:
        return f"{name} shape {tuple(a.shape)} != {tuple(e.shape)}"
    err = rel_rmse(a, e)
    if not err <= tol:
        return f"{name} rel_rmse {err:.2e} > {tol:.0e}"
    worst = ((a.double() - e.double()).abs().max() / e.double().abs().max().clamp_min(1e-30)).item()
    if not worst <= 8 * tol:
        return f"{name} max error {worst:.2e} of max|ref| > {8 * tol:.0e}"
    return None


def check_outputs(got, want, dtype: torch.dtype, tol: Optional[float] = None) -> Optional[str]:
    """None when ``got`` matches the baseline ``want`` (o, final state), else why not."""
    tol = TOLERANCE.get(dtype, 1e-2) if tol is None else tol
    for name, a, e in zip(("o", "final_state"), got, want):
        problem = _compare(name, a, e, tol)
        if problem:
            return problem
    return None


def check_grads(got: dict, want: dict, dtype: torch.dtype, tol: Optional[float] = None) -> Optional[str]:
    """None when every tensor of a forward + backward step (``{"o": ..., "dq": ...}``) matches the
    default config's, else why not (the first that does not)."""
    tol = GRAD_TOLERANCE.get(dtype, 2e-2) if tol is None else tol
    if set(got) != set(want):
        return f"tensors {sorted(set(got) ^ set(want))} missing or unexpected"
    for name in want:
        problem = _compare(name, got[name], want[name], tol)
        if problem:
            return problem
    return None


def cotangents(inputs: dict, seed: int = 0) -> tuple:
    """Fixed random gradients for ``o`` and the final state of a call on ``inputs``."""
    gen = torch.Generator().manual_seed(seed + 1)
    q, v = inputs["q"], inputs["v"]
    B, T, HV, V = v.shape
    cu = inputs.get("cu_seqlens")
    N = B if cu is None else cu.numel() - 1
    do = torch.randn(B, T, HV, V, generator=gen).to(device=v.device, dtype=v.dtype)
    dht = torch.randn(N, HV, q.shape[-1], V, generator=gen).to(v.device)
    return do, dht


def make_backward_runner(fn: Callable, grads_out: tuple) -> Callable:
    """``run(inputs, BT) -> {"o", "final_state", "d<input>"...}``: one forward + backward step of
    the generated chunk function ``fn`` with the cotangents ``grads_out`` = (dO, dht)."""
    def run(inputs: dict, BT: int) -> dict:
        leaves = {n: x.detach().requires_grad_(True) for n, x in inputs.items()
                  if isinstance(x, torch.Tensor) and x.is_floating_point()}
        o, ht = fn(**{**inputs, **leaves}, output_final_state=True, chunk_size=BT)
        grads = torch.autograd.grad((o, ht), tuple(leaves.values()), grads_out, allow_unused=True)
        out = {"o": o.detach(), "final_state": ht.detach()}
        out.update({f"d{n}": g for n, g in zip(leaves, grads)})
        return out
    return run


def _stage_default(stage: str, sizes: dict, per_channel: bool = False) -> dict:
    if _space.is_backward(stage):
        return default_backward_tiles(_space.runtime_stage(stage), **sizes, per_channel=per_channel)
    return default_tiles(stage, **sizes, per_channel=per_channel)


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


def _run_setup(shapes: Iterable, device: Optional[DeviceInfo], timer: Optional[Callable], progress):
    """What every tuning run starts from: (device info, timer, progress tick, torch device, ShapeCases).
    Without a GPU (or under the interpreter) the stand-in device, wall-clock timing, CPU tensors."""
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    dev = "cuda" if on_gpu else "cpu"
    cases = [s if isinstance(s, ShapeCase) else
             ShapeCase(*s, dtype=torch.bfloat16 if on_gpu else torch.float32) for s in shapes]
    return (device or current_device() or INTERPRETER_DEVICE, timer or default_timer(on_gpu),
            _progress_fn(progress), dev, cases)


def tune(spec, shapes: Iterable, *, module=None, timer: Optional[Callable] = None,
         stages: Optional[Iterable[str]] = None, chunk_sizes: Optional[Iterable[int]] = None,
         device: Optional[DeviceInfo] = None, cache_dir=None, max_candidates: Optional[int] = None,
         tol: Optional[float] = None, min_gain: float = 0.01, progress=False, write: bool = True,
         seed: int = 0, runner: Optional[Callable] = None,
         backward_runner: Optional[Callable] = None) -> TuneReport:
    """Tune ``spec``'s generated chunk forward (and backward) for ``shapes``; winners to the cache.

    Args:
        spec: the Spec (its generated module is ``generated.<name>`` unless ``module`` is given).
        shapes: ShapeCase objects, or ``(B, T, H, HV, K, V)`` tuples (bf16 on a GPU, fp32 otherwise).
        timer: ``timer(fn, candidate) -> ms``; default the device time per call on CUDA
            (:func:`device_time_ms`: the host's issue time left out, so small shapes rank by their
            kernels), wall-clock under the interpreter.
        stages: stage names and group words (default ``fwd``): forward wy, state, output, state_output
            (the state pass of a forward nothing differentiates, which writes the output); backward
            wy_prep_bwd, intra_bwd, state_bwd, chunk_bwd, wy_bwd, wy_decay_bwd; ``fwd``, ``bwd``,
            ``all``. Stages the spec does not launch are skipped.
        chunk_sizes: subset of ``spec.chunk.sizes`` (default all of them).
        device: the DeviceInfo the cache is written for (default: the current GPU; without one,
            a stand-in "triton-interpreter" device - smoke testing only).
        max_candidates: cap per stage, default included (the candidates nearest the default).
        tol: rel. RMSE tolerance of the check against the default config (default per dtype:
            ``TOLERANCE`` for the forward, ``GRAD_TOLERANCE`` for forward + backward steps).
        min_gain: a candidate must beat the default by this fraction to replace it (timing noise).
        progress: True for a bar on stderr, or a ``(i, n, label)`` callable.
        write: write winners to the cache (``cache_dir`` or $GDNGEN_CACHE_DIR or ~/.cache/gdngen).
        runner: ``runner(inputs, BT) -> (o, final_state)``; default calls the generated function.
        backward_runner: ``backward_runner(inputs, BT) -> {name: tensor}`` for backward stages;
            default :func:`make_backward_runner` (o, final state and every input's gradient of one
            forward + backward step with fixed random cotangents).
    """
    if module is None:
        module = importlib.import_module(f"generated.{spec.name}")
    device, timer, tick, dev, cases = _run_setup(shapes, device, timer, progress)
    chunk_list = list(chunk_sizes) if chunk_sizes else _space.chunk_sizes(spec)
    bad = [c for c in chunk_list if c not in spec.chunk.sizes]
    if bad:
        raise ValueError(f"chunk_sizes: {bad} not among spec.chunk.sizes {list(spec.chunk.sizes)}")
    if isinstance(stages, str):
        stages = stages.split(",")
    wanted = _space.expand_stages(stages) if stages else list(_space.STAGES)
    if not wanted:
        raise ValueError("stages: none given")
    fwd_wanted = [s for s in wanted if not _space.is_backward(s)]
    bwd_wanted = [s for s in wanted if _space.is_backward(s)]
    bwd_stages = _space.backward_stages_for(spec) if bwd_wanted else []
    if bwd_wanted and not bwd_stages:
        raise ValueError(f"stages: {spec.name} has no generated Triton backward; backward stages cannot be tuned")
    fn = getattr(module, spec.chunk_function)
    vector = _space.per_channel(spec)

    def default_run(inputs, BT):
        # the forward as training and long prefills launch it: a short inference call's state pass
        # may write the output itself (tiles.fused_output), which would leave the output stage untuned
        with override(spec.name, "fused_output", value=False):
            return fn(**inputs, output_final_state=True, chunk_size=BT)

    def fused_run(inputs, BT):
        with override(spec.name, "fused_output", value=True), torch.no_grad():
            return fn(**inputs, output_final_state=True, chunk_size=BT)

    def stage_candidates(stage, case, BT, sizes):
        return _space.candidates(stage, K=case.K, V=case.V, BT=BT, dtype=case.dtype,
                                 default=_stage_default(stage, sizes, vector), device=device, limit=max_candidates,
                                 per_channel=vector)

    run = runner or default_run
    report = TuneReport()
    entries: dict[str, dict] = {}

    # a rough count for the progress bar: candidates per stage are only known per shape
    tunable = [s for s in _space.stages_for(spec) if s in fwd_wanted] + [s for s in bwd_stages if s in bwd_wanted]
    total, counter = 0, [0]
    per_stage_counts = {}
    for case in cases:
        for BT in chunk_list:
            sizes = dict(K=case.K, V=case.V, BT=BT, N=case.B, HV=case.HV, dtype=case.dtype)
            for stage in tunable:
                cands = stage_candidates(stage, case, BT, sizes)
                per_stage_counts[(case, BT, stage)] = cands
                total += len(cands)

    def step(label):
        counter[0] += 1
        tick(min(counter[0], total), max(total, 1), label)

    def tune_one(case, BT, stage, sizes, current, run_fn, inputs, reference, check):
        configs = per_stage_counts.get((case, BT, stage)) or stage_candidates(stage, case, BT, sizes)
        result = _tune_stage(spec, case, BT, stage, configs, current, run_fn, inputs, reference,
                             timer, tol, device, step, min_gain, check=check)
        report.results.append(result)
        # the cache holds tiles; a path switch the candidates share (state_output's TMA) stays the
        # default's at lookup, so a device without it reads the same entry
        tiles_only = {k: v for k, v in result.winner.config.items()
                      if k in _space.config_keys(stage) + _space.optional_keys(stage)}
        entries[result.key] = _cache.make_entry(
            tiles_only, spec_hash=spec.hash, ms=round(result.winner.ms, 6),
            default_ms=round(result.default.ms, 6), candidates=len(result.candidates),
            rejected=len(result.rejected), shape=case.label)
        return result

    def advice(case, stage, totals):
        best_bt = min(totals, key=totals.get)
        key = _cache.entry_key(spec.name, stage, _cache.shape_class(
            H=case.H, HV=case.HV, K=case.K, V=case.V, dtype=case.dtype, BT=0, N=case.B, T=case.T,
            sm_count=device.sm_count))
        entries[key] = _cache.make_entry({"chunk_size": best_bt}, spec_hash=spec.hash, ms=round(totals[best_bt], 6),
                                         chunk_ms={str(b): round(t, 6) for b, t in totals.items()},
                                         shape=case.label)
        return best_bt

    try:
        for case in cases:
            inputs = make_inputs(spec, B=case.B, T=case.T, H=case.H, HV=case.HV, K=case.K, V=case.V,
                                 dtype=case.dtype, device=dev, seed=seed)
            run_bwd = None
            if bwd_wanted:
                run_bwd = backward_runner or make_backward_runner(fn, cotangents(inputs, seed))
            for BT in chunk_list:
                sizes = dict(K=case.K, V=case.V, BT=BT, N=case.B, HV=case.HV, dtype=case.dtype)
                fwd_best = {s: default_tiles(s, **sizes, per_channel=vector) for s in _space.STAGES}
                if fwd_wanted:
                    with record_stages() as seen:
                        with poisoned_memory():
                            with _pinned(spec.name, fwd_best):
                                reference = run(inputs, BT)
                    launched = [s for s in _space.STAGES if s in seen]
                    current = {s: fwd_best[s] for s in launched}
                    best_total = None
                    for stage in [s for s in launched if s in fwd_wanted]:
                        result = tune_one(case, BT, stage, sizes, current, run, inputs, reference, check_outputs)
                        current[stage] = fwd_best[stage] = dict(result.winner.config)
                        best_total = result.winner.ms
                    if best_total is not None:
                        report.chunk_totals[(case, BT)] = best_total
                    if "state_output" in fwd_wanted and "state_output" in tunable and runner is None:
                        # the state pass that writes the output runs only in a forward nothing
                        # differentiates: tuned on one, the other stages at their best so far
                        with record_stages() as seen:
                            with poisoned_memory():
                                with _pinned(spec.name, fwd_best):
                                    fused_reference = fused_run(inputs, BT)
                        if "state_output" in seen:
                            result = tune_one(case, BT, "state_output", sizes, dict(fwd_best), fused_run, inputs,
                                              fused_reference, check_outputs)
                            fwd_best["state_output"] = dict(result.winner.config)
                if bwd_wanted:
                    # forward stages at their best so far, backward stages at their defaults
                    bwd_defaults = {s: _stage_default(s, sizes, vector) for s in bwd_stages}
                    with record_stages() as seen:
                        with poisoned_memory():
                            with _pinned(spec.name, {**fwd_best, **bwd_defaults}):
                                reference = run_bwd(inputs, BT)
                    launched = [s for s in _space.BACKWARD_STAGES if s in seen and s in bwd_defaults]
                    current = {**fwd_best, **{s: bwd_defaults[s] for s in launched}}
                    best_total = None
                    for stage in [s for s in launched if s in bwd_wanted]:
                        result = tune_one(case, BT, stage, sizes, current, run_bwd, inputs, reference, check_grads)
                        current[stage] = dict(result.winner.config)
                        best_total = result.winner.ms
                    if best_total is not None:
                        report.train_totals[(case, BT)] = best_total
            totals = {BT: report.chunk_totals[(case, BT)] for BT in chunk_list if (case, BT) in report.chunk_totals}
            if totals:
                report.chunk_winners[case] = advice(case, "chunk", totals)
            totals = {BT: report.train_totals[(case, BT)] for BT in chunk_list if (case, BT) in report.train_totals}
            if totals:
                report.train_chunk_winners[case] = advice(case, "chunk_train", totals)
    finally:
        if progress:
            tick(max(total, 1), max(total, 1), "done")
        if write and entries:
            report.cache_path = str(_cache.write_entries(device, entries, directory=cache_dir))
    return report


SEGMENT_COUNTS = (1, 2, 4, 8, 16)


def tune_split(spec, shapes: Iterable, *, module=None, timer: Optional[Callable] = None, chunk_size: int = 64,
               segment_counts: Iterable[int] = SEGMENT_COUNTS, device: Optional[DeviceInfo] = None, cache_dir=None,
               tol: Optional[float] = None, min_gain: float = 0.01, progress=False, write: bool = True,
               seed: int = 0) -> list[dict]:
    """Tune the intra-card split (``gdngen.parallel.split_sequence_forward``): per shape, the number
    of segments each sequence is cut into, 1 (no split) included and the default.

    Each count's outputs (o and the final state, fresh allocations NaN-poisoned) are compared with
    the unsplit call's before it is timed; a count must beat no split by ``min_gain`` to win. The
    winner goes to the cache under ``<spec>/split/<shape class>`` (``cache.segments_hint``), which
    ``split_sequence_forward(segments="auto")`` runs (untuned: no split). Returns one row
    per (shape, count): ``shape``, ``segments``, ``ms`` or ``rejected``, ``winner`` (bool).
    """
    from gdngen.parallel import split_sequence_forward
    if module is None:
        module = importlib.import_module(f"generated.{spec.name}")
    if chunk_size not in spec.chunk.sizes:
        raise ValueError(f"chunk_size: {chunk_size} not among spec.chunk.sizes {list(spec.chunk.sizes)}")
    counts = sorted(set(int(c) for c in segment_counts) | {1})
    if counts[0] < 1:
        raise ValueError(f"segment_counts: expected positive ints, got {list(segment_counts)}")
    device, timer, tick, dev, cases = _run_setup(shapes, device, timer, progress)
    fn = getattr(module, spec.chunk_function)
    rows, entries = [], {}
    total, done = len(cases) * len(counts), 0
    for case in cases:
        inputs = make_inputs(spec, B=case.B, T=case.T, H=case.H, HV=case.HV, K=case.K, V=case.V,
                             dtype=case.dtype, device=dev, seed=seed)
        timed = {}
        reference = None
        for segments in counts:
            done += 1
            tick(done, total, f"{case.label} split segments={segments}")

            def call(segments=segments):
                return split_sequence_forward(fn, **inputs, segments=segments, output_final_state=True,
                                              chunk_size=chunk_size)
            row = {"shape": case.label, "segments": segments}
            try:
                with poisoned_memory():
                    got = call()
                if reference is None:
                    reference = got
                    problem = None
                else:
                    problem = check_outputs(got, reference, case.dtype, tol)
                if problem is None:
                    row["ms"] = timed[segments] = float(timer(call, Candidate("split", chunk_size, {"segments": segments})))
                else:
                    row["rejected"] = problem
            except Exception as exc:  # noqa: BLE001 - a count that fails is data, never chosen
                if _fatal(exc):
                    raise TuningAborted(f"split segments={segments} left the device unusable ({exc})") from exc
                row["rejected"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            rows.append(row)
        if 1 not in timed:
            raise RuntimeError(f"{case.label}: the unsplit call failed ({rows[-len(counts)].get('rejected')}); "
                               "not tuning the split")
        best = min(timed, key=timed.get)
        if timed[best] > timed[1] * (1.0 - min_gain):
            best = 1
        for row in rows[-len(counts):]:
            row["winner"] = row["segments"] == best
        key = _cache.entry_key(spec.name, _cache.SPLIT_STAGE, _cache.shape_class(
            H=case.H, HV=case.HV, K=case.K, V=case.V, dtype=case.dtype, BT=chunk_size, N=case.B, T=case.T,
            sm_count=device.sm_count))
        entries[key] = _cache.make_entry({"segments": best}, spec_hash=spec.hash, ms=round(timed[best], 6),
                                         default_ms=round(timed[1], 6), shape=case.label,
                                         segment_ms={str(c): round(t, 6) for c, t in timed.items()})
    if write and entries:
        _cache.write_entries(device, entries, directory=cache_dir)
    return rows


RECURRENT_BV = (8, 16, 32, 64, 128)
RECURRENT_WARPS = (1, 2, 4, 8)


def tune_recurrent(spec, shapes: Iterable, *, module=None, timer: Optional[Callable] = None,
                   state_dtype: torch.dtype = torch.float32, device: Optional[DeviceInfo] = None, cache_dir=None,
                   tol: Optional[float] = None, min_gain: float = 0.01, max_candidates: Optional[int] = None,
                   progress=False, write: bool = True, seed: int = 0) -> list[dict]:
    """Tune the token-recurrent kernel (``fused_recurrent_<name>``, decode): V tile and warps per shape.

    ``shapes``: ShapeCase with T = tokens per call (1 for decode). Each candidate ``{BV, num_warps}``
    (the rule of thumb of ``gdngen.runtime.recurrent`` first) runs from the same ``state_dtype`` start
    state; its outputs and final state (fresh allocations NaN-poisoned) are compared with the
    default's before it is timed, updating a state in place as decode does. A candidate must beat the
    default by ``min_gain``. Winners go to the cache under ``<spec>/recurrent/<shape class>`` (keyed by
    the state dtype), which ``recurrent_tiles`` reads. Returns one row per (shape, candidate).
    """
    from gdngen.runtime import recurrent as _recurrent
    if module is None:
        module = importlib.import_module(f"generated.{spec.name}")
    fn = getattr(module, spec.recurrent_function, None)
    if fn is None:
        raise ValueError(f"stages: {spec.name} has no {spec.recurrent_function}; recurrent cannot be tuned")
    device, timer, tick, dev, cases = _run_setup(shapes, device, timer, progress)
    rows, entries = [], {}
    plans = []
    for case in cases:
        default = _recurrent.recurrent_tiles(spec.name, N=case.B, HV=case.HV, K=case.K, V=case.V,
                                             state_dtype=state_dtype, device=torch.device(dev))
        base = {"BV": default["BV"], "num_warps": default["num_warps"]}
        widest = max(8, 1 << max(0, (case.V - 1).bit_length()))
        space = [{"BV": bv, "num_warps": w} for bv in RECURRENT_BV for w in RECURRENT_WARPS
                 if bv <= widest and {"BV": bv, "num_warps": w} != base
                 and default["BK"] * bv // (32 * w) <= 256]          # state values per thread: no spill storm
        space.sort(key=lambda c: (abs((c["BV"].bit_length()) - base["BV"].bit_length())
                                  + abs(c["num_warps"].bit_length() - base["num_warps"].bit_length()), c["BV"],
                                  c["num_warps"]))
        configs = [base] + space
        if max_candidates:
            configs = configs[:max_candidates]
        plans.append((case, configs))
    total, done = sum(len(c) for _, c in plans), 0
    for case, configs in plans:
        inputs = make_inputs(spec, B=case.B, T=case.T, H=case.H, HV=case.HV, K=case.K, V=case.V,
                             dtype=case.dtype, device=dev, seed=seed)
        inputs.pop("initial_state", None)    # the tuner's own start state below
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        start = (0.1 * torch.randn(case.B, case.HV, case.K, case.V, generator=gen, device=dev)).to(state_dtype)
        live = start.clone()                  # the state the timed calls update in place, as decode does
        reference, timed, first = None, {}, len(rows)
        for cfg in configs:
            done += 1
            label = f"BV={cfg['BV']} num_warps={cfg['num_warps']}"
            tick(done, total, f"{case.label} recurrent {label}")
            row = {"shape": case.label, "config": dict(cfg), "default": cfg is configs[0]}
            try:
                with override(spec.name, _recurrent.STAGE, **cfg):
                    with poisoned_memory():
                        got = fn(**inputs, initial_state=start.clone(), output_final_state=True)
                    if reference is None:
                        reference, problem = got, None
                    else:
                        problem = check_outputs(got, reference, case.dtype, tol)
                    if problem is None:
                        step = lambda: fn(**inputs, initial_state=live, output_final_state=True)  # noqa: E731
                        row["ms"] = timed[label] = float(timer(step, Candidate(_recurrent.STAGE, 0, dict(cfg))))
                    else:
                        row["rejected"] = problem
            except Exception as exc:  # noqa: BLE001 - a config that fails is data, never chosen
                if _fatal(exc):
                    raise TuningAborted(f"recurrent {label} left the device unusable ({exc})") from exc
                row["rejected"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            rows.append(row)
        mine = rows[first:]
        if "ms" not in mine[0]:
            raise RuntimeError(f"{case.label}: the default recurrent config failed ({mine[0].get('rejected')})")
        best = min((r for r in mine if "ms" in r), key=lambda r: r["ms"])
        if best["ms"] > mine[0]["ms"] * (1.0 - min_gain):
            best = mine[0]
        for r in mine:
            r["winner"] = r is best
        key = _cache.entry_key(spec.name, _cache.RECURRENT_STAGE, _cache.shape_class(
            H=case.H, HV=case.HV, K=case.K, V=case.V, dtype=state_dtype, BT=0, N=case.B, T=case.T,
            sm_count=device.sm_count))
        entries[key] = _cache.make_entry(best["config"], spec_hash=spec.hash, ms=round(best["ms"], 6),
                                         default_ms=round(mine[0]["ms"], 6), shape=case.label)
    if write and entries:
        _cache.write_entries(device, entries, directory=cache_dir)
        _recurrent.forget()
    return rows


def format_recurrent_rows(rows: list[dict]) -> str:
    """The recurrent tuning rows as a table, the default and the winner of each shape marked."""
    lines = [f"{'shape (B,T,H,HV,K,V dtype)':<32} {'BV':>4} {'warps':>5} {'ms':>9}  note"]
    for r in rows:
        ms = f"{r['ms']:9.4f}" if "ms" in r else f"{'-':>9}"
        note = " ".join(x for x in ("default" if r.get("default") else "", "winner" if r.get("winner") else "",
                                    r.get("rejected") or "") if x)
        lines.append(f"{r['shape']:<32} {r['config']['BV']:>4} {r['config']['num_warps']:>5} {ms}  {note}")
    return "\n".join(lines)


def format_split_rows(rows: list[dict]) -> str:
    """The split tuning rows as a table, the winner of each shape marked."""
    lines = [f"{'shape (B,T,H,HV,K,V dtype)':<32} {'segments':>8} {'ms':>9}  note"]
    for r in rows:
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        note = "winner" if r.get("winner") else (r.get("rejected") or "")
        lines.append(f"{r['shape']:<32} {r['segments']:>8} {ms}  {note}")
    return "\n".join(lines)


def _tune_stage(spec, case: ShapeCase, BT: int, stage: str, configs: list, current: dict, run, inputs, reference,
                timer, tol, device: DeviceInfo, tick, min_gain: float = 0.0,
                check: Callable = check_outputs) -> StageResult:
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
            cand.rejected = check(got, reference, case.dtype, tol)
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
    lines = [f"{'shape (B,T,H,HV,K,V dtype)':<30} {'BT':>3} {'stage':<12} {'winner':<34} {'ms':>9} "
             f"{'default ms':>10} {'speedup':>7} {'tried':>5} {'rejected':>8}"]
    for r in report.results:
        cfg = " ".join(f"{k}={v}" for k, v in r.winner.config.items())
        lines.append(f"{r.shape.label:<30} {r.BT:>3} {r.stage:<12} {cfg:<34} {r.winner.ms:>9.3f} "
                     f"{r.default.ms:>10.3f} {r.default.ms / r.winner.ms:>6.2f}x {len(r.candidates):>5} "
                     f"{len(r.rejected):>8}")
        for c in r.rejected:
            lines.append(f"{'':<30} rejected {c.label}: {c.rejected}")
        host_timed = [c for c in r.candidates if c.host_included]
        if host_timed:
            lines.append(f"{'':<30} {len(host_timed)} of {len(r.candidates)} timed with the host's time included "
                         "(their calls synchronise: device_time_ms could not isolate the kernels)")
    for what, winners, all_totals, backward in (("chunk size", report.chunk_winners, report.chunk_totals, False),
                                                ("fwd+bwd chunk size", report.train_chunk_winners,
                                                 report.train_totals, True)):
        for case, bt in winners.items():
            totals = ", ".join(f"BT={b}: {t:.3f} ms" for (c, b), t in all_totals.items() if c == case)
            first = next((r for r in report.results if r.shape == case
                          and _space.is_backward(r.stage) == backward), None)
            defaults = "backward defaults" if backward else "all defaults"
            base = f"; {defaults} at BT={first.BT}: {first.default.ms:.3f} ms" if first else ""
            lines.append(f"{what} for {case.label}: {bt} (tuned totals {totals}{base})")
    return "\n".join(lines)


__all__ = ["Candidate", "ShapeCase", "StageResult", "TuneReport", "TuningAborted", "make_backward_runner",
           "check_grads", "check_outputs", "cotangents", "format_report", "tune"]
