"""GPU stress of the generated Gated DeltaNet chunk op (issue #11): numerics, long T, varlen, sweeps, soak,
determinism.  Written for one H200; every section has a time budget and stops cleanly when it runs out.

Sections (``--sections``, comma-separated, default all):

1. ``numerics``    log-gates 0, -1e-6, -5, -20, -1000, per-token mixes and masked (-inf); beta 0, 1, and
                   (0, 2) through ``2*sigmoid`` with ``allow_neg_eigval``; unnormalised keys with large norms;
                   fp16 near overflow; NaN/Inf in one packed sequence must not reach the others (bitwise).
2. ``long``        error vs float64 as T doubles from 4k to 1M (B=1, H=HV=4, K=V=128, bf16 and fp32), then one
                   case with B*T*H*K > 2^31 elements (T=2^21+2^16, H=8) checked on its first and last head.
3. ``varlen``      1200 packed sequences with lengths 0 and 1 among them, bf16 and fp32.
4. ``sweeps``      T from 128 doubling at B=1, H=16, HV=32 until memory or time runs out; B from 1 to 64 at
                   T=4096: ms, tokens/s, peak MiB (fwd and fwd+bwd); a drop of tokens/s by > 30% is a cliff.
5. ``soak``        random mixed shapes for --soak-seconds against float64; memory_allocated must stay flat.
6. ``determinism`` forward and backward bitwise equal over repeated runs, then again with most of the free
                   GPU memory held by another allocation.

Reference: ``gdngen.reference.run(..., form="chunked")`` in float64 on the GPU (chunk 64, or 256 for
T >= 65536 to cut the Python loop; exact in float64 for any chunk size).  The > 2^31-element case runs
the float64 reference on single heads (they are independent): head 0 and head H-1 (the largest offsets).

Every row is appended to $OUT/stress.jsonl as it is measured; a summary table is printed last.

    python benchmarks/stress_gpu.py                                  # all sections, ~12 min at most
    python benchmarks/stress_gpu.py --sections numerics,varlen       # ~3.5 min at most (4 calls of <= 4 min:
    python benchmarks/stress_gpu.py --sections long                  #  ~3 min          numerics+varlen, long,
    python benchmarks/stress_gpu.py --sections sweeps,determinism    # ~3.5 min         sweeps+determinism, soak)
    python benchmarks/stress_gpu.py --sections soak --soak-seconds 200
    python benchmarks/stress_gpu.py --dry-run                        # CPU, Triton interpreter, toy sizes (~90 s)
    python benchmarks/stress_gpu.py --plot benchmarks/results/FILE.jsonl [--png OUT.png]   # re-plot, no GPU

The ``long`` and ``sweeps`` rows are also drawn to $OUT/stress.png (``--plot`` redraws it from a jsonl and
prints the error table and the sweep figures): tokens/s and peak MiB against T, tokens/s against B, and
the error vs float64 against T (matplotlib when importable, else gdngen.plot's built-in rasteriser).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch                                    # noqa: E402
import torch.nn.functional as F                 # noqa: E402

from gdngen import reference                    # noqa: E402
from gdngen.selfcheck import poisoned_memory, rel_rmse   # noqa: E402
from gdngen.runtime.validate import GRID_ROWS      # noqa: E402
from gdngen.spec import load_spec               # noqa: E402

SECTIONS = ("numerics", "long", "varlen", "sweeps", "soak", "determinism")
# Seconds per section on the H200 (first calls compile for 7-13 s per new dtype/shape class).
DEFAULT_BUDGET_S = {"numerics": 150, "long": 170, "varlen": 60, "sweeps": 120, "soak": None, "determinism": 90}
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}
SPEC = load_spec(Path(__file__).resolve().parent.parent / "specs" / "gated_delta_rule.yaml")


class Ctx:
    """Run-wide settings: device, sizes (full or toy), output file, rows of this run."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.out = Path(os.environ.get("OUT", "stress_out"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "stress.jsonl"
        self.rows: list[dict] = []
        self.seed = args.seed
        # bf16 is not available under the interpreter (DESIGN §6): the dry run uses fp32 there
        self.low = torch.float32 if self.dry else torch.bfloat16
        self.K = 16 if self.dry else 128

    def log(self, section: str, row: dict) -> dict:
        row = {"section": section, **row}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)
        return row

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


class Deadline:
    def __init__(self, seconds):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def op():
    from generated.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def inputs(ctx, B, T, H, HV, K=None, V=None, dtype=torch.float32, *, lengths=None, h0=True, seed=0,
           gate_bias=2.0):
    """Random GDN inputs drawn on the device: L2-normalised k, g = logsigmoid(randn + gate_bias),
    beta = sigmoid(randn) (g, beta, initial_state in float32).  ``lengths``: packed varlen (B=1)."""
    K = K or ctx.K
    V = V or ctx.K
    gen = torch.Generator(device=ctx.device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=ctx.device, generator=gen)

    cu = None
    if lengths is not None:
        B, T = 1, int(sum(lengths))
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                          device=ctx.device)
    N = len(lengths) if lengths is not None else B
    x = {"q": randn(B, T, H, K).to(dtype), "k": F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
         "v": randn(B, T, HV, V).to(dtype), "g": F.logsigmoid(randn(B, T, HV) + gate_bias),
         "beta": torch.sigmoid(randn(B, T, HV)),
         "initial_state": randn(N, HV, K, V) * 0.5 if h0 else None, "cu_seqlens": cu}
    return x


def ours(x, **options):
    with poisoned_memory():
        return op()(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                    cu_seqlens=x["cu_seqlens"], output_final_state=True, **options)


def ref(x, chunk_size=None, form="chunked", **options):
    T = x["q"].shape[1]
    chunk = chunk_size or (256 if T >= 65536 else 64)
    with torch.no_grad():
        return reference.run(SPEC, x["q"], x["k"], x["v"], x["g"], x["beta"], form=form, chunk_size=chunk,
                             initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                             output_final_state=True, **options)


def compare(ctx, section, case, x, tol=None, extra=None, **options):
    """Run ours and the float64 reference; row with both errors, ok = within the dtype's tolerance.

    A kernel error (an exception) is a row with ``error``: acceptable only when it is a clear
    ValueError/TypeError naming an argument; anything else counts as a failure.  ``extra()`` is
    called after the outputs are freed and its keys join the row (the soak's memory reading).
    """
    dtype = x["q"].dtype
    tol = tol or TOL[dtype]
    row = {"case": case, "dtype": dname(dtype), "shape": list(x["q"].shape) + [x["v"].shape[2], x["v"].shape[3]],
           "tol": tol}
    try:
        o, ht = ours(x, **options)
    except (ValueError, TypeError) as exc:
        row.update(error=f"{type(exc).__name__}: {exc}", ok=True, clear_error=True)
    except Exception as exc:  # noqa: BLE001 - reported as a failure, the run goes on
        row.update(error=f"{type(exc).__name__}: {exc}"[:400], ok=False)
    else:
        o_ref, ht_ref = ref(x, **options)
        if not (torch.isfinite(o_ref).all() and torch.isfinite(ht_ref).all()):
            # the chunked form computes (-inf) - (-inf) for masked gates; the token recurrence is exact
            o_ref, ht_ref = ref(x, form="recurrent", **options)
            row["reference"] = "float64 recurrent (the chunked reference is non-finite here)"
        e_o, e_h = rel_rmse(o, o_ref), rel_rmse(ht, ht_ref)
        row.update(rel_rmse_o=e_o, rel_rmse_ht=e_h, ok=e_o <= tol and e_h <= tol)
        del o, ht, o_ref, ht_ref
    if extra:
        row.update(extra())
    return ctx.log(section, row)


# =============================================================================================
# 1. numerics
# =============================================================================================

def section_numerics(ctx, deadline):
    B, T, H, HV = (2, 100, 1, 2) if ctx.dry else (2, 1000, 2, 4)
    dtypes = [torch.float32] if ctx.dry else [torch.float32, torch.bfloat16, torch.float16]
    gates = [0.0, -1e-6, -5.0, -20.0, -1000.0]
    for dtype in dtypes:
        def case(name, fn=None, tol=None, **options):
            if deadline.over():
                return
            x = inputs(ctx, B, T, H, HV, dtype=dtype, seed=ctx.seed)
            if fn:
                fn(x)
            compare(ctx, "numerics", name, x, tol=tol, **options)

        for c in gates:
            case(f"g = {c:g} every token", lambda x, c=c: x["g"].fill_(c))

        def mixed(x):
            choice = torch.randint(0, len(gates), x["g"].shape, device=ctx.device)
            x["g"].copy_(torch.tensor(gates, device=ctx.device)[choice])
        case("g per token from {0,-1e-6,-5,-20,-1000}", mixed)

        def masked(x):
            x["g"].masked_fill_(torch.rand(x["g"].shape, device=ctx.device) < 0.05, float("-inf"))
        case("g = -inf (masked) at 5% of tokens", masked)
        case("beta = 0", lambda x: x["beta"].zero_())
        case("beta = 1", lambda x: x["beta"].fill_(1.0))

        def logits(scale):
            def fn(x):
                x["beta"].copy_(torch.randn_like(x["beta"]) * scale)
            return fn
        case("beta = 2*sigmoid(logits), allow_neg_eigval", logits(3.0),
             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
        case("beta in {0, 2} (logits +-30), allow_neg_eigval",
             lambda x: x["beta"].copy_(torch.sign(torch.randn_like(x["beta"])) * 30),
             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
        case("k x100 (norm ~100), in-kernel l2norm", lambda x: x.update(k=(x["k"].float() * 100).to(dtype)),
             use_qk_l2norm_in_kernel=True)
        case("q x100 (norm ~100)", lambda x: x.update(q=(x["q"].float() * 100).to(dtype)))

        def unnormalised(x):
            # ||k|| ~ 10: keep beta ||k||^2 <= 2 (beta <= 0.02) so the recurrence stays contractive
            x["k"] = (x["k"].float() * 10).to(dtype)
            x["beta"].mul_(0.02)
        case("k unnormalised, norm 10, beta <= 0.02", unnormalised)

        def edge(x):
            # ||k||^2 = 1.9, beta = 1: eigenvalue 1 - 1.9 = -0.9 (oscillating, still stable)
            x["k"] = (x["k"].float() * math.sqrt(1.9)).to(dtype)
            x["beta"].fill_(1.0)
        case("k norm sqrt(1.9), beta = 1 (eigenvalue -0.9)", edge)
        if dtype == torch.float16:
            case("fp16 v ~ 1e3", lambda x: x.update(v=(x["v"].float() * 1e3).to(dtype)))
            fp16_overflow(ctx, deadline, B, T, H, HV)
    nan_isolation(ctx, deadline, dtypes)


def fp16_overflow(ctx, deadline, B, T, H, HV):
    """q x300, v x1e3: some true outputs exceed 65504 and must be inf/NaN there; every representable
    element must still be within tolerance (and the float32 final state everywhere)."""
    if deadline.over():
        return
    x = inputs(ctx, B, T, H, HV, dtype=torch.float16, seed=ctx.seed)
    x["q"] = (x["q"].float() * 300).to(torch.float16)
    x["v"] = (x["v"].float() * 1e3).to(torch.float16)
    o, ht = ours(x)
    o_ref, ht_ref = ref(x)
    fits = o_ref.abs() < 6e4
    e_fit = rel_rmse(o[fits], o_ref[fits])
    e_h = rel_rmse(ht, ht_ref)
    ctx.log("numerics", {"case": "fp16 q x300, v x1e3 (true output beyond fp16)", "dtype": "float16",
                         "fraction_beyond_fp16": 1 - fits.float().mean().item(),
                         "rel_rmse_o_representable": e_fit, "rel_rmse_ht": e_h, "tol": 5e-3,
                         "ok": e_fit <= 5e-3 and e_h <= 5e-3})


def nan_isolation(ctx, deadline, dtypes):
    """NaN or Inf in one packed sequence (token or initial state) leaves the others bitwise unchanged."""
    lengths = [40, 37, 50] if ctx.dry else [300, 257, 1000]
    for dtype in dtypes:
        clean = inputs(ctx, 1, 0, 2, 4, dtype=dtype, lengths=lengths, seed=ctx.seed + 1)
        o0, h0 = ours(clean)
        start = lengths[0]
        for name in ("q", "k", "v", "g", "beta", "initial_state"):
            for bad in (float("nan"), float("inf")):
                if deadline.over():
                    return
                x = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in clean.items()}
                if name == "initial_state":
                    x[name][1, 0, 0, 0] = bad
                else:
                    x[name][0, start + 10] = bad
                o, h = ours(x)
                others = [slice(0, start), slice(start + lengths[1], sum(lengths))]
                same = all(torch.equal(o[:, s], o0[:, s]) for s in others) and \
                    torch.equal(h[[0, 2]], h0[[0, 2]])
                ctx.log("numerics", {"case": f"{bad} in {name} of sequence 1 of 3", "dtype": dname(dtype),
                                     "others_bitwise_equal": same,
                                     "bad_sequence_nonfinite": not torch.isfinite(o[:, start + 10:start + 11]).all().item()
                                     if name != "initial_state" else not torch.isfinite(h[1]).all().item(),
                                     "ok": same})


# =============================================================================================
# 2. long sequences
# =============================================================================================

def section_long(ctx, deadline):
    H = HV = 2 if ctx.dry else 4
    Ts = [64 * 2 ** i for i in range(3)] if ctx.dry else [4096 * 2 ** i for i in range(9)]   # to 1,048,576
    tail = 32 if ctx.dry else 4096
    for dtype in ([torch.float32] if ctx.dry else [ctx.low, torch.float32]):
        for T in Ts:
            if deadline.left() < (1 if ctx.dry else 20):
                ctx.log("long", {"case": f"T={T}", "dtype": dname(dtype), "skipped": "time budget", "ok": True})
                continue
            x = inputs(ctx, 1, T, H, HV, dtype=dtype, seed=ctx.seed + T)
            start = time.perf_counter()
            o, ht = ours(x)
            ctx.sync()
            kernel_s = time.perf_counter() - start
            o_ref, ht_ref = ref(x)
            ctx.log("long", {"case": f"T={T}", "dtype": dname(dtype), "T": T, "H": H, "HV": HV,
                             "reference": "float64 chunked on the device",
                             "rel_rmse_o": rel_rmse(o, o_ref), "rel_rmse_ht": rel_rmse(ht, ht_ref),
                             "rel_rmse_o_last_tokens": rel_rmse(o[:, -tail:], o_ref[:, -tail:]),
                             "kernel_s": kernel_s, "tol": TOL[dtype],
                             "ok": rel_rmse(o, o_ref) <= TOL[dtype] and rel_rmse(ht, ht_ref) <= TOL[dtype]})
            del x, o, ht, o_ref, ht_ref
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
    huge(ctx, deadline)


def huge(ctx, deadline):
    """B*T*H*K > 2^31 elements (2^31 + 2^26: element offsets past the int32 range, as issue #11 asks;
    stop 17 ran exactly 2^31, whose last offset still fits): heads 0 and H-1 vs float64 and vs the
    same head run alone (small offsets)."""
    B, T, H, K = (1, 512, 4, 16) if ctx.dry else (1, 2 ** 21 + 2 ** 16, 8, 128)
    if deadline.left() < (1 if ctx.dry else 60):
        ctx.log("long", {"case": "B*T*H*K > 2^31", "skipped": "time budget", "ok": True})
        return
    x = inputs(ctx, B, T, H, H, K=K, V=K, dtype=ctx.low, seed=ctx.seed + 7, h0=True)
    elements = B * T * H * K
    try:
        o, ht = ours(x)
        ctx.sync()
    except Exception as exc:  # noqa: BLE001
        ctx.log("long", {"case": "B*T*H*K > 2^31", "elements": elements, "error": repr(exc)[:400], "ok": False})
        return
    tail = 64 if ctx.dry else 4096
    for h in (0, H - 1):
        one = {n: (x[n][:, :, h:h + 1].contiguous() if n in ("q", "k", "v", "g", "beta") else x[n])
               for n in ("q", "k", "v", "g", "beta")}
        one["initial_state"] = x["initial_state"][:, h:h + 1].contiguous()
        one["cu_seqlens"] = None
        o_small, ht_small = ours(one)
        o_ref, ht_ref = ref(one, chunk_size=256)
        o_h, ht_h = o[:, :, h:h + 1], ht[:, h:h + 1]
        row = {"case": f"B*T*H*K = {elements} (2^{math.log2(elements):.2f}), head {h}", "dtype": dname(ctx.low),
               "shape": [B, T, H, K], "elements": elements,
               "rel_rmse_o": rel_rmse(o_h, o_ref), "rel_rmse_ht": rel_rmse(ht_h, ht_ref),
               "rel_rmse_o_last_tokens": rel_rmse(o_h[:, -tail:], o_ref[:, -tail:]),
               "rel_diff_vs_head_alone": rel_rmse(o_h, o_small), "ht_diff_vs_head_alone": rel_rmse(ht_h, ht_small),
               "tol": TOL[ctx.low]}
        row["ok"] = max(row["rel_rmse_o"], row["rel_rmse_ht"], row["rel_rmse_o_last_tokens"]) <= 2 * TOL[ctx.low]
        ctx.log("long", row)
        del one, o_small, o_ref, ht_ref
    del x, o, ht
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


# =============================================================================================
# 3. many sequences
# =============================================================================================

def section_varlen(ctx, deadline):
    rng = random.Random(ctx.seed)
    count = 40 if ctx.dry else 1200

    def length():
        r = rng.random()
        return 0 if r < 0.15 else 1 if r < 0.3 else rng.randint(2, 64) if r < 0.7 else \
            rng.randint(65, 200 if ctx.dry else 3000)
    lengths = [0, 1] + [length() for _ in range(count - 2)]
    rng.shuffle(lengths)
    H, HV = (1, 2) if ctx.dry else (4, 8)
    for dtype in ([torch.float32] if ctx.dry else [ctx.low, torch.float32]):
        if deadline.over():
            return
        x = inputs(ctx, 1, 0, H, HV, dtype=dtype, lengths=lengths, seed=ctx.seed + 3)
        row = compare(ctx, "varlen", f"{len(lengths)} sequences, {lengths.count(0)} empty, "
                      f"{lengths.count(1)} of length 1, {sum(lengths)} tokens", x)
        o, ht = ours(x)
        empty = [i for i, n in enumerate(lengths) if n == 0]
        kept = torch.equal(ht[empty], x["initial_state"][empty])
        ctx.log("varlen", {"case": "empty sequences hand back their initial state", "dtype": dname(dtype),
                           "sequences": len(lengths), "empty": len(empty), "bitwise": kept,
                           "ok": kept and row["ok"]})


# =============================================================================================
# 4. sweeps
# =============================================================================================

def timed(ctx, fn, grads=None):
    """(first call s, median ms, peak MiB) of ``fn``."""
    ctx.sync()
    start = time.perf_counter()
    fn()
    ctx.sync()
    first = time.perf_counter() - start
    if ctx.device != "cuda":
        start = time.perf_counter()
        fn()
        return first, (time.perf_counter() - start) * 1e3, None
    import triton
    for t in grads or []:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    ms = triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grads, return_mode="median")
    return first, ms, peak


def sweep_point(ctx, label, B, T, H, HV, mode):
    x = inputs(ctx, B, T, H, HV, dtype=ctx.low, h0=False, seed=ctx.seed)
    f = op()
    leaves = None
    if mode == "fwd+bwd":
        leaves = [x[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        do = torch.randn(B, T, HV, ctx.K, device=ctx.device, dtype=ctx.low)

        def fn():
            f(*leaves)[0].backward(do)
    else:
        def fn():
            with torch.no_grad():
                f(x["q"], x["k"], x["v"], x["g"], x["beta"])
    first, ms, peak = timed(ctx, fn, leaves)
    return ctx.log("sweeps", {"case": label, "mode": mode, "B": B, "T": T, "H": H, "HV": HV, "dtype": dname(ctx.low),
                              "first_call_s": first, "ms": ms, "tokens_per_s": B * T / ms * 1e3, "peak_mib": peak,
                              "ok": True})


def section_sweeps(ctx, deadline):
    H, HV = (1, 2) if ctx.dry else (16, 32)
    # past 65535 chunks of 64 (T > 2^22 - 64) the op refuses the call (CUDA's grid-axis limit)
    t_max = 256 if ctx.dry else min(2 ** 24, GRID_ROWS * 64)
    for mode in ("fwd", "fwd+bwd"):
        T, previous = 128 if not ctx.dry else 32, None
        while T <= t_max and not deadline.over():
            try:
                row = sweep_point(ctx, "T sweep", 1, T, H, HV, mode)
            except Exception as exc:  # noqa: BLE001 - out of memory ends the sweep; anything else is a failure
                oom = isinstance(exc, torch.cuda.OutOfMemoryError)
                ctx.log("sweeps", {"case": "T sweep", "mode": mode, "T": T, "error": repr(exc)[:300], "oom": oom,
                                   "ok": oom})
                if ctx.device == "cuda":
                    torch.cuda.empty_cache()
                break
            cliff(ctx, row, previous)
            previous, T = row, T * 2
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
        B, previous, T = 1, None, (64 if ctx.dry else 4096)
        while B <= (4 if ctx.dry else 64) and not deadline.over():
            try:
                row = sweep_point(ctx, "B sweep", B, T, H, HV, mode)
            except Exception as exc:  # noqa: BLE001
                oom = isinstance(exc, torch.cuda.OutOfMemoryError)
                ctx.log("sweeps", {"case": "B sweep", "mode": mode, "B": B, "error": repr(exc)[:300], "oom": oom,
                                   "ok": oom})
                if ctx.device == "cuda":
                    torch.cuda.empty_cache()
                break
            cliff(ctx, row, previous)
            previous, B = row, B * 2


def cliff(ctx, row, previous):
    """Tokens/s should not fall by more than 30% as the problem grows (small sizes are launch-bound and rise)."""
    if previous is None or ctx.dry:
        return
    ratio = row["tokens_per_s"] / previous["tokens_per_s"]
    if ratio < 0.7:
        ctx.log("sweeps", {"case": f"cliff in {row['case']}", "mode": row["mode"], "from": [previous["B"], previous["T"]],
                           "to": [row["B"], row["T"]], "tokens_per_s_ratio": ratio, "ok": False})


# =============================================================================================
# 5. soak
# =============================================================================================

def section_soak(ctx, deadline):
    rng = random.Random(ctx.seed + 11)
    # Head counts and dims are compile-time constants: a few classes keep the soak measuring rather than
    # compiling (7-13 s per new class); the variety is in B, T, lengths, gates, values and options.
    classes = [(1, 2, 16, 16)] if ctx.dry else [(2, 4, 128, 128)] * 3 + [(4, 4, 128, 128), (1, 2, 64, 64)]
    dtypes = [torch.float32] if ctx.dry else [torch.float32, torch.bfloat16, torch.float16]
    if ctx.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    def allocated():
        if ctx.device != "cuda":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    mem0, warm = allocated(), None
    cases = failures = 0
    drift = []
    while not deadline.over():
        H, HV, K, V = rng.choice(classes)
        dtype = rng.choice(dtypes)
        options = {}
        if rng.random() < 0.5:
            lengths = [rng.choice([0, 1, rng.randint(2, 64), rng.randint(2, 64 if ctx.dry else 2000)])
                       for _ in range(rng.randint(1, 8))]
            x = inputs(ctx, 1, 0, H, HV, K, V, dtype=dtype, lengths=lengths, seed=rng.randrange(1 << 30))
            shape = f"varlen {lengths}"
        else:
            B, T = rng.randint(1, 4), rng.randint(1, 100 if ctx.dry else 4096)
            x = inputs(ctx, B, T, H, HV, K, V, dtype=dtype, seed=rng.randrange(1 << 30), h0=rng.random() < 0.7)
            shape = f"B={B} T={T}"
        if rng.random() < 0.3:
            options = dict(use_qk_l2norm_in_kernel=True)
        # inputs are counted in "before"; after the call everything but the inputs must be gone again
        before = allocated()
        row = compare(ctx, "soak", f"{shape} H={H} HV={HV} K={K} V={V} {options or ''}".strip(), x,
                      extra=lambda: {"allocated_before": before, "allocated_after": allocated()}, **options)
        del x
        drift.append(row["allocated_after"] - row["allocated_before"])
        cases += 1
        failures += not row["ok"]
        if cases == 5:
            warm = allocated()     # first calls may cache small per-device tables once
    mem1 = allocated()
    ctx.log("soak", {"case": "memory_allocated flat over the soak", "cases": cases, "failures": failures,
                     "allocated_start": mem0, "allocated_after_5_cases": warm, "allocated_end": mem1,
                     "max_growth_in_one_call": max(drift, default=0),
                     # memory alone: every case has its own row and verdict
                     "ok": cases > 0 and mem1 == (warm if warm is not None else mem1)
                     and max(drift[5:], default=0) == 0})


# =============================================================================================
# 6. determinism
# =============================================================================================

def run_once(x, do, dht):
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = op()(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                 initial_state=leaves["initial_state"], cu_seqlens=x["cu_seqlens"], output_final_state=True)
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    return [o.detach(), ht.detach(), *grads]


def section_determinism(ctx, deadline):
    repeats = 2 if ctx.dry else 10
    shapes = ([("dense", dict(B=2, T=100, H=1, HV=2)), ("varlen", dict(lengths=[30, 0, 1, 70]))] if ctx.dry else
              [("dense", dict(B=2, T=4096, H=4, HV=8)), ("varlen", dict(lengths=[3000, 0, 1, 64, 65, 5000, 777]))])
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for label, shape in shapes:
        x = inputs(ctx, shape.get("B", 1), shape.get("T", 0), 2 if "lengths" in shape else shape["H"],
                   4 if "lengths" in shape else shape["HV"], dtype=ctx.low, lengths=shape.get("lengths"),
                   seed=ctx.seed + 5)
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
        do = torch.randn(x["v"].shape, device=ctx.device, generator=gen).to(ctx.low)
        dht = torch.randn(x["initial_state"].shape, device=ctx.device, generator=gen)
        first = run_once(x, do, dht)
        for pressure in (False, True):
            if deadline.over():
                return
            blob = None
            if pressure:
                if ctx.device != "cuda":
                    ctx.log("determinism", {"case": f"{label} under memory pressure", "skipped": "no GPU", "ok": True})
                    continue
                free, _ = torch.cuda.mem_get_info()
                blob = torch.empty(int(free * 0.85), dtype=torch.uint8, device="cuda")   # most of free memory
            differing = set()
            runs = 0
            for _ in range(repeats):
                if deadline.over():
                    break
                for name, a, b in zip(names, first, run_once(x, do, dht)):
                    if not torch.equal(a, b):
                        differing.add(name)
                runs += 1
            held = blob.numel() / 2 ** 30 if blob is not None else 0
            del blob
            ctx.log("determinism", {"case": f"{label}{' under memory pressure' if pressure else ''}",
                                    "dtype": dname(ctx.low), "runs": runs, "held_gib": held,
                                    "not_bitwise_equal": sorted(differing), "ok": runs > 0 and not differing})
        if ctx.device == "cuda":
            torch.cuda.empty_cache()


# =============================================================================================
# Plot and figures: from rows (this run's, or a committed jsonl); no GPU needed
# =============================================================================================

def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _points(rows, case, mode, x, y):
    return sorted((r[x], r[y]) for r in rows
                  if r.get("section") == "sweeps" and r.get("case") == case and r.get("mode") == mode
                  and r.get(y) is not None and r.get(x) is not None)


def _oom(rows, case, mode):
    """The size the sweep ran out of memory at (T for the T sweep, B for the B sweep), or None."""
    key = "T" if case == "T sweep" else "B"
    return next((r.get(key) for r in rows if r.get("section") == "sweeps" and r.get("case") == case
                 and r.get("mode") == mode and r.get("oom")), None)


def _shape(rows, case):
    r = next((r for r in rows if r.get("section") == "sweeps" and r.get("case") == case and "ms" in r), None)
    return f"H={r['H']} HV={r['HV']} {r['dtype']}" if r else ""


def sweep_figures(rows: list[dict]) -> list[dict]:
    """Per (sweep, mode): points, tokens/s range, the largest drop of tokens/s between neighbours
    (ratio < 1; None when every step rises), the log-log slope of peak MiB against the swept size
    (least squares; 1 = linear) and the size it ran out of memory at."""
    out = []
    for case, key in (("T sweep", "T"), ("B sweep", "B")):
        for mode in ("fwd", "fwd+bwd"):
            tps = _points(rows, case, mode, key, "tokens_per_s")
            if not tps:
                continue
            steps = [(a[0], b[0], b[1] / a[1]) for a, b in zip(tps, tps[1:])]
            worst = min(steps, key=lambda s: s[2], default=None)
            mem = [(math.log2(x), math.log2(y)) for x, y in _points(rows, case, mode, key, "peak_mib") if y > 0]
            slope = None
            if len(mem) > 1:
                mx, my = sum(x for x, _ in mem) / len(mem), sum(y for _, y in mem) / len(mem)
                slope = sum((x - mx) * (y - my) for x, y in mem) / sum((x - mx) ** 2 for x, _ in mem)
            peak = _points(rows, case, mode, key, "peak_mib")
            out.append({"sweep": case, "mode": mode, "key": key, "points": len(tps), "from": tps[0][0],
                        "to": tps[-1][0], "tokens_per_s_min": min(y for _, y in tps),
                        "tokens_per_s_max": max(y for _, y in tps), "largest_drop": worst if worst and worst[2] < 1
                        else None, "peak_mib_slope": slope, "peak_mib_last": peak[-1][1] if peak else None,
                        "oom_at": _oom(rows, case, mode)})
    return out


def format_figures(rows: list[dict]) -> str:
    """Markdown: the long section's error table, the > 2^31-element case, the sweep figures."""
    lines = []
    errs = {(r["T"], r["dtype"]): r for r in rows if r.get("section") == "long" and "T" in r and "rel_rmse_o" in r}
    if errs:
        dtypes = list(dict.fromkeys(d for _, d in errs))
        lines += ["| T | " + " | ".join(f"{d} o | {d} final state" for d in dtypes) + " |",
                  "|---|" + "---|---|" * len(dtypes)]
        for T in sorted({t for t, _ in errs}):
            cells = []
            for d in dtypes:
                r = errs.get((T, d))
                cells += [f"{r['rel_rmse_o']:.3e}", f"{r['rel_rmse_ht']:.3e}"] if r else ["", ""]
            lines.append(f"| {T:,} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("section") == "long" and "elements" in r and "rel_rmse_o" in r:
            lines.append(f"{r['case']} {r['dtype']} {r['shape']}: o {r['rel_rmse_o']:.3e}, final state "
                         f"{r['rel_rmse_ht']:.3e}, last tokens {r['rel_rmse_o_last_tokens']:.3e}; vs the head alone: "
                         f"o {r['rel_diff_vs_head_alone']:.3e}, final state {r['ht_diff_vs_head_alone']:.3e}")
    for f in sweep_figures(rows):
        drop = f["largest_drop"]
        lines.append(
            f"{f['sweep']} {f['mode']}: {f['points']} points, {f['key']} {f['from']:,}..{f['to']:,}, tokens/s "
            f"{f['tokens_per_s_min']:.4g}..{f['tokens_per_s_max']:.4g}, largest drop "
            + (f"{1 - drop[2]:.1%} ({f['key']} {drop[0]:,} -> {drop[1]:,})" if drop else "none (every step rises)")
            + (f", peak MiB slope {f['peak_mib_slope']:.4f} (last {f['peak_mib_last']:g} MiB)"
               if f["peak_mib_slope"] is not None else "")
            + (f", out of memory at {f['key']} {f['oom_at']:,}" if f["oom_at"] else ""))
    return "\n".join(lines)


def plot_panels(rows: list[dict]):
    """The four panels of the PNG (gdngen.plot.Panel); panels without points are dropped by the writer."""
    from gdngen.plot import _PALETTE, Panel, Series, _pow2
    mode_colour = {"fwd": _PALETTE[0], "fwd+bwd": _PALETTE[1]}
    modes = ("fwd", "fwd+bwd")

    def oom_note(case):
        key = "T" if case == "T sweep" else "B"
        notes = [f"{m} at {_pow2(_oom(rows, case, m)) if key == 'T' else _oom(rows, case, m)}" for m in modes
                 if _oom(rows, case, m)]
        return f" (out of memory: {', '.join(notes)})" if notes else ""

    t_shape, b_shape = _shape(rows, "T sweep"), _shape(rows, "B sweep")
    b_T = next((r["T"] for r in rows if r.get("case") == "B sweep" and "ms" in r), None)
    panels = [
        Panel(f"(a) tokens/s vs T, B=1 {t_shape}",
              [Series(m, _points(rows, "T sweep", m, "T", "tokens_per_s"), mode_colour[m]) for m in modes],
              xlabel="T" + oom_note("T sweep"), xlog2=True),
        Panel(f"(b) peak MiB vs T (log-log), B=1 {t_shape}",
              [Series(m, _points(rows, "T sweep", m, "T", "peak_mib"), mode_colour[m]) for m in modes],
              xlabel="T", xlog2=True, ylog=True),
        Panel(f"(c) tokens/s vs B, T={b_T} {b_shape}",
              [Series(m, _points(rows, "B sweep", m, "B", "tokens_per_s"), mode_colour[m]) for m in modes],
              xlabel="B" + oom_note("B sweep"), xlog2=True),
    ]
    long_rows = [r for r in rows if r.get("section") == "long" and "rel_rmse_o" in r]
    series = []
    dtypes = list(dict.fromkeys(r["dtype"] for r in long_rows if "T" in r))
    for i, d in enumerate(dtypes):
        colour = _PALETTE[(2 + i) % len(_PALETTE)]
        mine = [r for r in long_rows if r.get("dtype") == d and "T" in r]
        series += [Series(f"{d} o", [(r["T"], r["rel_rmse_o"]) for r in mine], colour),
                   Series(f"{d} final state", [(r["T"], r["rel_rmse_ht"]) for r in mine], colour, dashed=True)]
        tol = next((r["tol"] for r in mine if "tol" in r), None)
        if tol:
            Ts = [r["T"] for r in mine]
            series.append(Series(f"{d} tol", [(min(Ts), tol), (max(Ts), tol)], _PALETTE[7], dashed=True))
    big = [r for r in long_rows if "elements" in r and "rel_rmse_o" in r]
    if big:
        series.append(Series(f"B*T*H*K = 2^{math.log2(big[0]['elements']):.2f} ({big[0]['dtype']}, H={big[0]['shape'][2]}) o, heads "
                             + " and ".join(r["case"].split("head ")[-1] for r in big),
                             [(r["shape"][1], r["rel_rmse_o"]) for r in big], _PALETTE[4], join=False))
    head = next(iter(long_rows), {})
    panels.append(Panel(f"(d) rel-RMSE vs float64, B=1 H=HV={head.get('H', '?')}", series, xlabel="T",
                        xlog2=True, ylog=True))
    return panels


def write_plot(rows: list[dict], path: Path) -> Path | None:
    """PNG of the long and sweeps rows (2 x 2 panels); None when there is nothing to plot."""
    from gdngen.plot import write_line_panels
    try:
        return write_line_panels(plot_panels(rows), Path(path), columns=2)
    except ValueError:
        print("plot: no long or sweeps rows, no PNG", file=sys.stderr)
        return None


# =============================================================================================

def summary(ctx) -> int:
    print("\n| section | rows | ok | failed | skipped | worst / notes |")
    print("|---|---|---|---|---|---|")
    bad_total = 0
    for section in SECTIONS:
        rows = [r for r in ctx.rows if r["section"] == section]
        if not rows:
            continue
        bad = [r for r in rows if not r.get("ok", True)]
        skipped = [r for r in rows if "skipped" in r]
        bad_total += len(bad)
        notes = "; ".join(r["case"] for r in bad[:4])
        if section in ("long",):
            errs = [(r.get("T") or r["case"], r.get("dtype"), r.get("rel_rmse_o")) for r in rows if "rel_rmse_o" in r]
            notes = notes or ", ".join(f"{t} {d}: {e:.2e}" for t, d, e in errs)
        if section == "sweeps":
            pts = [r for r in rows if "ms" in r]
            notes = notes or f"{len(pts)} points, largest T {max((r['T'] for r in pts), default=0)}"
        print(f"| {section} | {len(rows)} | {len(rows) - len(bad) - len(skipped)} | {len(bad)} | {len(skipped)} | "
              f"{notes[:300]} |")
    print(f"\nrows: {ctx.path}  ({'all ok' if not bad_total else f'{bad_total} failed'})")
    return 1 if bad_total else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds per section (default: numerics 150, long 170, varlen 60, sweeps 120, "
                             "determinism 90; soak: --soak-seconds)")
    parser.add_argument("--soak-seconds", type=float, default=None, help="soak length (default 120; dry run 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, toy sizes: checks the script")
    parser.add_argument("--plot", metavar="FILE.jsonl", default=None,
                        help="no measuring: draw the PNG and print the error table and sweep figures from a "
                             "jsonl of this script")
    parser.add_argument("--png", default=None, help="with --plot: PNG path (default: FILE with .png)")
    args = parser.parse_args(argv)
    if args.plot:
        rows = read_rows(Path(args.plot))
        png = write_plot(rows, Path(args.png) if args.png else Path(args.plot).with_suffix(".png"))
        print(format_figures(rows))
        if png:
            print(f"\nplot: {png}")
        return 0
    if args.dry_run != DRY and args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"      # called in-process (tests): the caller set it before triton
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        parser.error(f"--sections: expected a comma-separated subset of {list(SECTIONS)}, got {args.sections!r}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here; --dry-run checks the script on CPU")
    ctx = Ctx(args)
    ctx.log("env", {"case": "environment", "device": "cpu (dry run)" if ctx.dry else torch.cuda.get_device_name(),
                    "torch": torch.__version__, "sections": chosen, "ok": True})
    for name in chosen:
        if name == "soak":
            seconds = args.soak_seconds if args.soak_seconds is not None else (3 if ctx.dry else 120)
        else:
            seconds = args.budget if args.budget is not None else (120 if ctx.dry else DEFAULT_BUDGET_S[name])
        start = time.perf_counter()
        print(f"== {name} (budget {seconds:g} s)", file=sys.stderr, flush=True)
        globals()[f"section_{name}"](ctx, Deadline(seconds))
        ctx.log(name, {"case": "section time", "seconds": time.perf_counter() - start, "ok": True})
    if {"long", "sweeps"} & set(chosen):
        try:
            png = write_plot(ctx.rows, ctx.out / "stress.png")
            if png:
                print(format_figures(ctx.rows) + f"\nplot: {png}")
        except Exception as exc:  # noqa: BLE001 - the rows are written; the plot can be redrawn with --plot
            print(f"plot failed ({type(exc).__name__}: {exc}); redraw with --plot {ctx.path}", file=sys.stderr)
    return summary(ctx)


if __name__ == "__main__":
    sys.exit(main())
