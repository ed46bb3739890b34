"""GDN chunk forward+backward on one GPU: gdngen's generated backward vs FLA's (issue #4).

One process, in order:
1. gradients of gdngen vs autograd through the float64 reference at a smaller T (every gradient,
   including dh0 with a gradient on the final state, and the fused gate/beta/l2norm options);
2. gradients of gdngen vs FLA's at each benchmark case (when FLA imports);
3. per case and implementation: forward+backward median time (triton.testing.do_bench) and peak
   memory (peak allocated minus allocated before the step, inputs and do already allocated).
Every row is appended to $OUT/backward.jsonl as soon as it is measured; a table is printed last.

    python benchmarks/bench_backward.py [--impls gdngen,fla] [--cases all|small]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")   # time FLA's own Triton path

import torch
import triton

from gdngen import reference
from gdngen.bench import Case
from gdngen.bench import floor_ms as bench_floor_ms
from gdngen.selfcheck import rel_rmse
from gdngen.spec import load_spec

from bench_prefill import inputs as forward_inputs   # the same q, k, v, g, beta as the forward benchmark

CASES = [(1, 32768, 32, 32), (4, 8192, 16, 32)]
SMALL_CASES = [(1, 4096, 16, 32)]
K = V = 128
NAMES = ("q", "k", "v", "g", "beta")
OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
ROWS = os.path.join(OUT, "backward.jsonl")
# Targets from the issue: fwd+bwd <= 0.8x FLA's time, peak memory at (1,32768,32,32) <= 1968 MiB.
FLA_ISSUE_MS = {(1, 32768, 32, 32): 8.08, (4, 8192, 16, 32): 7.74}
MEMORY_BOUND_MIB = {(1, 32768, 32, 32): 1968}


def floor_ms(B, T, H, HV):
    """H200 roofline floor of forward+backward (gdngen.bench.floor_ms)."""
    return bench_floor_ms(Case("backward", B, T, H, HV, K, V), "fwd+bwd")


def log(row: dict) -> None:
    with open(ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def inputs(B, T, H, HV, dtype=torch.bfloat16, seed=0):
    """The forward benchmark's inputs, as leaves that want gradients, and an output gradient."""
    q, k, v, g, beta = forward_inputs(B, T, H, HV, dtype=dtype, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(v.shape, device="cuda", generator=gen).to(dtype)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)], do


def implementations(names):
    impls = {}
    if "gdngen" in names:
        from generated.gated_delta_rule import chunk_gated_delta_rule as ours
        impls["gdngen"] = ours
    if "fla" in names:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
            impls["fla"] = fla
        except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"FLA unavailable: {exc!r}")
    return impls


def grads_of(fn, leaves, do, **kwargs):
    for x in leaves:
        x.grad = None
    o, _ = fn(*leaves, **kwargs)
    o.backward(do)
    return [x.grad.clone() for x in leaves]


def check_vs_reference(spec):
    """Every gradient of gdngen against autograd through the float64 reference (chunked form)."""
    from generated.gated_delta_rule import chunk_gated_delta_rule as ours
    tol = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "initial_state": 8e-3,
           "A_log": 2e-2, "dt_bias": 2e-2}
    for label, B, T, H, HV, fused in [("bf16 dense GVA h0 dht", 2, 2048, 4, 8, False),
                                      ("bf16 fused gates+l2norm h0 dht", 1, 1500, 2, 4, True)]:
        (q, k, v, g, beta), do = inputs(B, T, H, HV, seed=1)
        gen = torch.Generator(device="cuda").manual_seed(2)
        h0 = (torch.randn(B, HV, K, V, device="cuda", generator=gen) * 0.5).requires_grad_(True)
        dht = torch.randn(B, HV, K, V, device="cuda", generator=gen)
        kwargs, leaves = {}, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
        if fused:
            with torch.no_grad():
                g.copy_(torch.randn_like(g))
                beta.copy_(torch.randn_like(beta))
            A_log = torch.randn(HV, device="cuda", generator=gen).requires_grad_(True)
            dt_bias = torch.randn(HV, device="cuda", generator=gen).requires_grad_(True)
            kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
            leaves.update(A_log=A_log, dt_bias=dt_bias)
        pos, kw = [leaves[n] for n in NAMES], {n: leaves[n] for n in leaves if n not in NAMES}
        o, ht = ours(*pos, **kw, **kwargs, output_final_state=True)
        got = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
        ref = {n: x.detach().double().requires_grad_(True) for n, x in leaves.items()}
        ro, rht = reference.run(spec, *[ref[n] for n in NAMES], form="chunked", output_final_state=True,
                                **{n: ref[n] for n in ref if n not in NAMES}, **kwargs)
        want = torch.autograd.grad((ro, rht), list(ref.values()), (do.double(), dht.double()))
        errors = {n: rel_rmse(a, b) for n, a, b in zip(leaves, got, want)}
        log({"kind": "check_reference", "case": label, "rel_rmse": errors,
             "ok": all(errors[n] <= tol[n] for n in errors)})


def check_vs_fla(impls, cases):
    if "fla" not in impls or "gdngen" not in impls:
        return
    for B, T, H, HV in cases:
        leaves, do = inputs(B, T, H, HV, seed=3)
        ours = grads_of(impls["gdngen"], leaves, do)
        theirs = grads_of(impls["fla"], leaves, do)
        log({"kind": "check_fla", "case": [B, T, H, HV],
             "rel_rmse_vs_fla": {n: rel_rmse(a, b) for n, a, b in zip(NAMES, ours, theirs)}})
        del leaves, do, ours, theirs
        torch.cuda.empty_cache()


def check_segments(cases):
    """The time-segmented backward (gdngen.runtime.segments, B == 1) against the one-call backward at the
    benchmark's single-sequence cases: every gradient (bitwise equality expected: the same kernels on the
    same chunks), and the peak of each (the memory the segments exist to save)."""
    from generated.gated_delta_rule import chunk_gated_delta_rule as ours
    from gdngen.runtime import segments
    from gdngen.runtime.tiles import override
    for B, T, H, HV in cases:
        if B != 1:
            continue
        leaves, do = inputs(B, T, H, HV, seed=5)
        chosen = segments.backward_segments("gated_delta_rule", B=B, T=T, HV=HV, K=K, V=V, BT=64, varlen=False)
        results = {}
        for label, forced in (("segmented", None), ("one call", 1)):
            ctx = override("gated_delta_rule", "backward_segments", value=forced) if forced else None
            if ctx is not None:
                ctx.__enter__()
            try:
                grads_of(ours, leaves, do)                       # compile
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                grads = grads_of(ours, leaves, do)
                torch.cuda.synchronize()
                results[label] = (grads, (torch.cuda.max_memory_allocated() - base) / 2**20)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
        (a, peak_a), (b, peak_b) = results["segmented"], results["one call"]
        log({"kind": "check_segments", "case": [B, T, H, HV], "segments": chosen,
             "bitwise_equal": {n: bool(torch.equal(x, y)) for n, x, y in zip(NAMES, a, b)},
             "rel_rmse": {n: rel_rmse(x, y) for n, x, y in zip(NAMES, a, b)},
             "peak_mib_segmented_step": peak_a, "peak_mib_one_call_step": peak_b})
        del leaves, do, results, a, b
        torch.cuda.empty_cache()


def bench(impls, cases):
    for B, T, H, HV in cases:
        leaves, do = inputs(B, T, H, HV)
        for name, fn in impls.items():
            def step():
                o, _ = fn(*leaves)
                o.backward(do)
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                for x in leaves:
                    x.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                for x in leaves:
                    x.grad = None
                ms = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=leaves, return_mode="median")
            except Exception as exc:  # noqa: BLE001
                log({"kind": "time", "impl": name, "case": [B, T, H, HV], "error": repr(exc)[:300]})
                continue
            floor = floor_ms(B, T, H, HV)
            log({"kind": "time", "impl": name, "case": [B, T, H, HV], "fwd_bwd_ms": ms, "peak_mib": peak,
                 "first_call_s": first, "tokens_per_s": B * T / ms * 1e3, "floor_ms": floor,
                 "floor_fraction": floor / ms})
        del leaves, do
        torch.cuda.empty_cache()


def table():
    rows = [json.loads(line) for line in open(ROWS)]
    by_case = {}
    for r in rows:
        if r["kind"] == "time" and "fwd_bwd_ms" in r:
            by_case.setdefault(tuple(r["case"]), {})[r["impl"]] = r
    print("\n| case (B,T,H,HV) | impl | fwd+bwd ms | Mtok/s | peak MiB | first call s | % of floor | vs FLA here "
          "| target ms (0.8x FLA 8.08/7.74) | memory bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, impls in by_case.items():
        for name, r in impls.items():
            fla = impls.get("fla", {}).get("fwd_bwd_ms")
            ratio = f"{r['fwd_bwd_ms'] / fla:.2f}x" if fla else "-"
            target = 0.8 * FLA_ISSUE_MS[case] if case in FLA_ISSUE_MS else float("nan")
            bound = MEMORY_BOUND_MIB.get(case)
            share = r.get("floor_ms", floor_ms(*case)) / r["fwd_bwd_ms"]
            print(f"| {case} | {name} | {r['fwd_bwd_ms']:.2f} | {r['tokens_per_s'] / 1e6:.2f} | {r['peak_mib']:.0f} | "
                  f"{r['first_call_s']:.1f} | {100 * share:.0f}% | {ratio} | {target:.2f} | {bound if bound else '-'} |")
    for r in rows:
        if r["kind"].startswith("check"):
            print(r)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", default="gdngen,fla")
    parser.add_argument("--cases", default="all", choices=["all", "small"])
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-segments", action="store_true",
                        help="with --skip-check: still compare the segmented backward with the one-call one")
    args = parser.parse_args()
    spec = load_spec("specs/gated_delta_rule.yaml")
    cases = CASES if args.cases == "all" else SMALL_CASES
    impls = implementations(args.impls.split(","))
    if not args.skip_check and "gdngen" in impls:
        check_vs_reference(spec)
    if not args.skip_check:
        check_vs_fla(impls, cases)
    if "gdngen" in impls and (not args.skip_check or args.check_segments):
        check_segments(cases)
    bench(impls, cases)
    table()


if __name__ == "__main__":
    main()
