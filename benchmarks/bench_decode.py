"""Decode (T = 1) benchmark on one GPU: gdngen's fused_recurrent_gated_delta_rule beside FLA's.

HV = 32 value heads (H = 16 query/key heads), K = V = 128, bf16 q/k/v, float32 g/beta, for
B in {1, 64, 256} sequences:

1. checks: gdngen's outputs and final states against the float64 recurrence and against FLA's
   ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` on the same inputs;
2. time per call, eager (host included) and under CUDA-graph replay (torch.cuda.CUDAGraph: 20 calls
   captured in one graph, and one call per graph), and the state bandwidth: bytes of the touched
   state read plus written per second. gdngen runs in two modes: ``pool`` (a state pool updated in
   place through state_indices, the serving path) and ``dense`` (initial_state in, a new final
   state out -- what FLA does); bf16 state pools too;
3. a sweep of the recurrent kernel's launch parameters (V tile BV, warps) under graph replay, each
   candidate first checked against the default's outputs -- the data to set the defaults in
   gdngen/runtime/recurrent.py;
4. speculative verify (4 draft tokens, per-token states kept) + commit, and the bf16 pool's drift
   against float32 over 1024 decode steps.

Every row goes to $OUT/decode.jsonl as soon as it is measured; a table is printed last. About two
minutes on an H200 (most of it compiling the sweep's kernels).

    python benchmarks/bench_decode.py [--skip-sweep] [--batches 1,64,256]
    python benchmarks/bench_decode.py --dry-run     # CPU, interpreter, tiny shapes, no timing: checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

START = time.perf_counter()     # the time limit counts from here (imports included)

os.environ.setdefault("FLA_FLASH_QLA", "0")   # FLA's own Triton path
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gdngen import reference  # noqa: E402
from gdngen.runtime.recurrent import recurrent_tiles  # noqa: E402
from gdngen.runtime.tiles import override  # noqa: E402
from gdngen.selfcheck import rel_rmse  # noqa: E402
from gdngen.serving import StatePool, commit_accepted, decode_step, verify_draft  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402

H, HV, K, V = (1, 2, 16, 16) if DRY else (16, 32, 128, 128)
DEVICE = "cpu" if DRY else "cuda"
COPY_CEILING = 4.27e12          # H200 device-to-device copy, bytes/s (read + write)
GRAPH_CALLS = 20                # calls captured per graph for the per-call replay time
OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
ROWS = os.path.join(OUT, "decode.jsonl")
SPEC = "gated_delta_rule"
SWEEP = {
    torch.float32: [(8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8),
                    (128, 4), (128, 8), (128, 16)],
    torch.bfloat16: [(16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8), (128, 16)],
}
if DRY:
    SWEEP = {dtype: [(8, 1), (16, 1)] for dtype in SWEEP}


def log(row: dict) -> None:
    with open(ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def inputs(B: int, T: int = 1, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    return {
        "q": randn(B, T, H, K).bfloat16(),
        "k": F.normalize(randn(B, T, H, K), dim=-1).bfloat16(),
        "v": randn(B, T, HV, V).bfloat16(),
        "g": F.logsigmoid(randn(B, T, HV) + 2.0),
        "beta": torch.sigmoid(randn(B, T, HV)),
        "h0": randn(B, HV, K, V) * 0.5,
    }


def load_fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla
        return fla
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        log({"kind": "note", "msg": f"FLA unavailable: {exc!r}"[:300]})
        return None


def sync():
    if not DRY:
        torch.cuda.synchronize()


def time_eager(fn, reps: int = 200) -> float:
    """Microseconds per call, host included (a serving loop without graphs)."""
    reps = 1 if DRY else reps
    for _ in range(1 if DRY else 10):
        fn()
    sync()
    best = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best.append((time.perf_counter() - start) / reps * 1e6)
    return sorted(best)[1]


def capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def time_graph(fn, calls: int, budget_ms: float = 20.0) -> float:
    """Microseconds per call under CUDA-graph replay (``calls`` captured per graph), median of 5
    repeats of about ``budget_ms`` of back-to-back replays each."""
    if DRY:          # no graphs on CPU: run the calls once, report nothing
        for _ in range(calls):
            fn()
        return float("nan")
    graph = capture(fn, calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(5, min(2000, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return sorted(times)[2]


def state_bytes(B: int, dtype: torch.dtype) -> int:
    return 2 * B * HV * K * V * torch.finfo(dtype).bits // 8      # read + write


# ---- checks --------------------------------------------------------------------------------------

def check(ours, fla, spec) -> bool:
    ok = True
    for B in ((4,) if DRY else (4, 64)):
        x = inputs(B, T=3, seed=1)
        o, ht = ours(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True)
        o_ref, ht_ref = reference.run(spec, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                      output_final_state=True)
        row = {"kind": "check", "B": B, "T": 3, "vs": "float64", "rel_rmse_o": rel_rmse(o, o_ref),
               "rel_rmse_state": rel_rmse(ht, ht_ref)}
        row["ok"] = row["rel_rmse_o"] <= 5e-3 and row["rel_rmse_state"] <= 1e-5
        ok &= row["ok"]
        log(row)
        if fla is not None:
            row = {"kind": "check", "B": B, "T": 3, "vs": "fla"}
            try:
                o_fla, ht_fla = fla(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"],
                                    output_final_state=True)
                row.update(rel_rmse_o=rel_rmse(o, o_fla.to(o.dtype)), rel_rmse_state=rel_rmse(ht, ht_fla),
                           fla_o_vs_float64=rel_rmse(o_fla, o_ref))
                row["ok"] = row["rel_rmse_o"] <= 5e-3 and row["rel_rmse_state"] <= 1e-5
            except Exception as exc:  # noqa: BLE001 - the peer's failure is reported, not fatal
                row.update(ok=False, error=repr(exc)[:300])
            ok &= row["ok"]
            log(row)
        # the pool path gives the dense path's answer, bitwise
        pool = StatePool(B + 3, HV, K, V, device=DEVICE)
        slots = pool.allocate_many(B, x["h0"])
        o_pool = decode_step(ours, pool, pool.indices(slots), x["q"], x["k"], x["v"], x["g"], x["beta"])
        same = torch.equal(o_pool, o) and torch.equal(pool.states[slots], ht)
        ok &= same
        log({"kind": "check", "B": B, "T": 3, "vs": "dense path", "bitwise_equal": same})
    return ok


# ---- timing --------------------------------------------------------------------------------------

def bench_decode(ours, fla, batches):
    for B in batches:
        x = inputs(B)
        q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
        for dtype in (torch.float32, torch.bfloat16):
            pool = StatePool(B, HV, K, V, dtype=dtype, device=DEVICE)
            slots = pool.allocate_many(B, x["h0"])
            index = pool.indices(slots)
            cases = {"gdngen-pool": lambda: decode_step(ours, pool, index, q, k, v, g, beta)}
            if dtype == torch.float32:
                h0 = x["h0"]
                cases["gdngen-dense"] = lambda: ours(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                if fla is not None:
                    cases["fla"] = lambda: fla(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True)
            for impl, fn in cases.items():
                row = {"kind": "decode", "impl": impl, "state": dtype_name(dtype), "B": B, "H": H, "HV": HV, "K": K, "V": V}
                if impl.startswith("gdngen"):
                    row["config"] = recurrent_tiles(SPEC, N=B, HV=HV, K=K, V=V, state_dtype=dtype, device=q.device)
                try:
                    row["eager_us"] = time_eager(fn)
                    row["graph_us"] = time_graph(fn, GRAPH_CALLS)
                    row["graph1_us"] = time_graph(fn, 1)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = repr(exc)[:300]
                    log(row)
                    continue
                row["state_TBps"] = state_bytes(B, dtype) / (row["graph_us"] * 1e-6) / 1e12
                row["copy_ceiling_fraction"] = row["state_TBps"] * 1e12 / COPY_CEILING
                log(row)
            del pool
        torch.cuda.empty_cache()


def sweep(ours, batches, deadline: float):
    """Every candidate (BV, num_warps), checked against the default's outputs, timed under graph replay.

    Stops (with a note) once ``time.perf_counter()`` passes ``deadline``: the run must fit its slot.
    """
    for dtype, candidates in SWEEP.items():
        for B in batches:
            x = inputs(B)
            pool = StatePool(B, HV, K, V, dtype=dtype, device=DEVICE)
            slots = pool.allocate_many(B, x["h0"])
            index = pool.indices(slots)
            start_states = pool.states.clone()
            o_default = decode_step(ours, pool, index, x["q"], x["k"], x["v"], x["g"], x["beta"])
            h_default = pool.states.clone()
            for BV, warps in candidates:
                if time.perf_counter() > deadline:
                    log({"kind": "note", "msg": f"sweep stopped at the time limit before {dtype_name(dtype)} B={B} "
                                                f"BV={BV} warps={warps}"})
                    return
                row = {"kind": "sweep", "state": dtype_name(dtype), "B": B, "BV": BV, "num_warps": warps}
                try:
                    with override(SPEC, "recurrent", BV=BV, num_warps=warps):
                        pool.states.copy_(start_states)
                        o = decode_step(ours, pool, index, x["q"], x["k"], x["v"], x["g"], x["beta"])
                        row["rel_rmse_o_vs_default"] = rel_rmse(o, o_default)
                        row["rel_rmse_state_vs_default"] = rel_rmse(pool.states, h_default)
                        if row["rel_rmse_o_vs_default"] > 1e-3 or row["rel_rmse_state_vs_default"] > 1e-5:
                            row["error"] = "outputs differ from the default config's"
                            log(row)
                            continue
                        row["graph_us"] = time_graph(
                            lambda: decode_step(ours, pool, index, x["q"], x["k"], x["v"], x["g"], x["beta"]), GRAPH_CALLS)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = repr(exc)[:300]
                    log(row)
                    continue
                row["state_TBps"] = state_bytes(B, dtype) / (row["graph_us"] * 1e-6) / 1e12
                log(row)
            del pool
            torch.cuda.empty_cache()


def bench_verify(ours, batches, drafts: int = 4):
    """verify_draft of 4 tokens (the state after each kept) + commit_accepted, under graph replay."""
    for B in batches:
        x = inputs(B, T=drafts, seed=3)
        pool = StatePool(B, HV, K, V, device=DEVICE)
        slots = pool.allocate_many(B, x["h0"])
        index = pool.indices(slots)
        buffer = pool.draft_buffer(B, drafts)
        accepted = torch.randint(0, drafts + 1, (B,), device=DEVICE, dtype=torch.int32)
        verify = lambda: verify_draft(ours, pool, index, x["q"], x["k"], x["v"], x["g"], x["beta"], draft_states=buffer)  # noqa: E731
        commit = lambda: commit_accepted(pool, index, buffer, accepted)  # noqa: E731
        row = {"kind": "verify", "B": B, "drafts": drafts}
        try:
            row["verify_graph_us"] = time_graph(verify, GRAPH_CALLS)
            row["commit_graph_us"] = time_graph(commit, GRAPH_CALLS)
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
            log(row)
            continue
        state = B * HV * K * V * 4
        row["verify_TBps"] = (state * (1 + drafts)) / (row["verify_graph_us"] * 1e-6) / 1e12
        row["commit_TBps"] = (2 * state) / (row["commit_graph_us"] * 1e-6) / 1e12
        log(row)
        del pool, buffer


def bf16_drift(ours, spec, B: int = 4, steps: int = 8 if DRY else 1024):
    """A bf16 pool against a float32 pool and the float64 recurrence over ``steps`` decode steps."""
    x = inputs(B, T=steps, seed=4)
    checkpoints = sorted({t for t in (1, 64, steps) if t <= steps})
    pools = {dtype: StatePool(B, HV, K, V, dtype=dtype, device=DEVICE) for dtype in (torch.float32, torch.bfloat16)}
    index = {dtype: p.indices(p.allocate_many(B, x["h0"])) for dtype, p in pools.items()}
    states = {dtype: {} for dtype in pools}
    for t in range(steps):
        step = [x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")]
        for dtype, p in pools.items():
            decode_step(ours, p, index[dtype], *step)
            if t + 1 in checkpoints:
                states[dtype][t + 1] = p.states.clone()
    for t in checkpoints:
        _, h_ref = reference.run(spec, *(x[n][:, :t] for n in ("q", "k", "v", "g", "beta")),
                                 initial_state=x["h0"], output_final_state=True)
        log({"kind": "bf16_drift", "tokens": t, "bf16_state_vs_float64": rel_rmse(states[torch.bfloat16][t], h_ref),
             "fp32_state_vs_float64": rel_rmse(states[torch.float32][t], h_ref)})


# ---- report --------------------------------------------------------------------------------------

def table():
    rows = [json.loads(line) for line in open(ROWS)]
    print("\n| impl | state | B | eager us | graph us/call (20 per graph) | graph us (1 per graph) | state TB/s | of 4.27 TB/s | config |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode" and "graph_us" in r:
            cfg = r.get("config")
            cfg = f"BV={cfg['BV']}, warps={cfg['num_warps']}" if cfg else ""
            print(f"| {r['impl']} | {r['state']} | {r['B']} | {r['eager_us']:.1f} | {r['graph_us']:.2f} | "
                  f"{r['graph1_us']:.2f} | {r['state_TBps']:.2f} | {100 * r['copy_ceiling_fraction']:.0f}% | {cfg} |")
    best = {}
    for r in rows:
        if r["kind"] == "sweep" and "graph_us" in r:
            key = (r["state"], r["B"])
            if key not in best or r["graph_us"] < best[key]["graph_us"]:
                best[key] = r
    if best:
        print("\nFastest sweep candidate per (state, B):")
        for (state, B), r in sorted(best.items()):
            print(f"  {state} B={B}: BV={r['BV']} num_warps={r['num_warps']}: {r['graph_us']:.2f} us, "
                  f"{r['state_TBps']:.2f} TB/s")
    for r in rows:
        if r["kind"] in ("check", "verify", "bf16_drift", "note"):
            print(r)
    decode = {(r["impl"], r["state"], r["B"]): r for r in rows if r["kind"] == "decode" and "graph_us" in r}
    big, one = decode.get(("gdngen-pool", "fp32", 256)), decode.get(("gdngen-pool", "fp32", 1))
    if big:
        print(f"\ntarget B=256 fp32 >= 3.85 TB/s: {big['state_TBps']:.2f} TB/s")
    if one:
        print(f"target B=1 <= 4 us under graph replay: {one['graph_us']:.2f} us/call (20 per graph), "
              f"{one['graph1_us']:.2f} us (1 per graph)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes: checks the script runs")
    parser.add_argument("--time-limit", type=float, default=200.0, help="seconds after which the sweep stops")
    args = parser.parse_args()
    batches = [1, 2] if DRY else [int(b) for b in args.batches.split(",")]
    from generated.gated_delta_rule import fused_recurrent_gated_delta_rule as ours
    spec = load_spec("specs/gated_delta_rule.yaml")
    fla = load_fla()
    t0 = START
    log({"kind": "env", "device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
         "triton": __import__("triton").__version__, "fla": fla is not None})
    with torch.no_grad():
        if not check(ours, fla, spec):
            log({"kind": "note", "msg": "a check failed: see the check rows"})
        bench_decode(ours, fla, batches)
        bench_verify(ours, [b for b in batches if b > 1])
        bf16_drift(ours, spec)
        if not args.skip_sweep:
            # the targets' cases first, in case the time limit cuts the sweep short
            order = [b for b in (256, 1) if b in batches] + [b for b in batches if b not in (256, 1)]
            sweep(ours, order, deadline=t0 + args.time_limit)
    log({"kind": "note", "msg": f"total {time.perf_counter() - t0:.0f} s"})
    table()


if __name__ == "__main__":
    main()
