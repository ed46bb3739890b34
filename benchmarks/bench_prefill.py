"""Side-by-side GDN chunk-forward benchmark on one GPU: gdngen vs FLA (Triton path) vs FlashQLA vs SDPA.

One process: first-call time of gdngen (compile included), a correctness check against the float64
reference, precision vs float64 at T=4096 for every implementation, then per case the median time
(triton.testing.do_bench), tokens/s, peak memory and the roofline floor. Every row is appended to
$OUT/prefill.jsonl as soon as it is measured, and a table is printed last.

    python benchmarks/bench_prefill.py [--cases all|long|short] [--impls gdngen,fla,flashqla,sdpa]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")   # time FLA's own Triton path

import torch
import torch.nn.functional as F
import triton

from gdngen.selfcheck import rel_rmse
from gdngen.spec import load_spec
from gdngen import reference
from gdngen.bench import Case
from gdngen.bench import floor_ms as bench_floor_ms

CASES = [(1, 32768, 32, 32), (4, 8192, 16, 32), (8, 2048, 16, 16), (1, 131072, 16, 32), (1, 32768, 2, 8)]
K = V = 128
OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
ROWS = os.path.join(OUT, "prefill.jsonl")


def log(row: dict) -> None:
    with open(ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def inputs(B, T, H, HV, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device="cuda", generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=gen))
    return q, k, v, g, beta


def implementations(names):
    impls = {}
    if "gdngen" in names:
        from generated.gated_delta_rule import chunk_gated_delta_rule as ours
        impls["gdngen"] = lambda q, k, v, g, b: ours(q, k, v, g, b)[0]
    if "fla" in names:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
            impls["fla"] = lambda q, k, v, g, b: fla(q, k, v, g, b)[0]
        except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"FLA unavailable: {exc!r}")
    if "flashqla" in names:
        try:
            from flash_qla import chunk_gated_delta_rule as fqla
            impls["flashqla"] = lambda q, k, v, g, b: fqla(q, k, v, g, b)[0]
        except Exception as exc:  # noqa: BLE001
            print(f"FlashQLA unavailable: {exc!r}")
    if "sdpa" in names:
        def sdpa(q, k, v, g, b):
            HV = v.shape[2]
            rep = HV // q.shape[2]
            qq = q.repeat_interleave(rep, 2).transpose(1, 2)
            kk = k.repeat_interleave(rep, 2).transpose(1, 2)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qq, kk, v.transpose(1, 2), is_causal=True)
        impls["sdpa"] = sdpa
    return impls


def floor_ms(B, T, H, HV):
    """Roofline floor of the GDN chunk forward (gdngen.bench.floor_ms)."""
    return bench_floor_ms(Case("prefill", B, T, H, HV, K, V), "fwd")


def check_correctness(spec):
    from generated.gated_delta_rule import chunk_gated_delta_rule as ours
    cases = [
        ("fp32 dense GVA h0", dict(B=2, T=1000, H=4, HV=8), torch.float32, {}),
        ("bf16 dense GVA h0", dict(B=2, T=1000, H=4, HV=8), torch.bfloat16, {}),
        ("fp16 varlen", dict(B=1, T=1500, H=2, HV=4), torch.float16, {"lengths": [1, 0, 700, 63, 64, 65, 607]}),
        ("bf16 fused gates+l2norm", dict(B=1, T=777, H=2, HV=4), torch.bfloat16, {"fused": True}),
    ]
    for label, shape, dtype, extra in cases:
        q, k, v, g, beta = inputs(**shape, dtype=dtype, seed=1)
        N = shape["B"]
        kwargs = {}
        if "lengths" in extra:
            cu = torch.tensor([0] + torch.tensor(extra["lengths"]).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
            kwargs["cu_seqlens"], N = cu, len(extra["lengths"])
        if extra.get("fused"):
            g = torch.randn_like(g)
            beta = torch.randn_like(beta)
            kwargs.update(use_gate_in_kernel=True, A_log=torch.randn(shape["HV"], device="cuda"),
                          dt_bias=torch.randn(shape["HV"], device="cuda"), use_beta_sigmoid_in_kernel=True,
                          use_qk_l2norm_in_kernel=True)
        h0 = torch.randn(N, shape["HV"], K, V, device="cuda") * 0.5
        o, ht = ours(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
        o_ref, ht_ref = reference.run(spec, q, k, v, g, beta, form="chunked", initial_state=h0,
                                      output_final_state=True, **kwargs)
        tol = 1e-5 if dtype == torch.float32 else 5e-3
        e_o, e_h = rel_rmse(o, o_ref), rel_rmse(ht, ht_ref)
        log({"kind": "check", "case": label, "rel_rmse_o": e_o, "rel_rmse_ht": e_h, "tol": tol,
             "ok": e_o <= tol and e_h <= tol})


def precision(spec, impls):
    q, k, v, g, beta = inputs(1, 4096, 16, 32, seed=2)
    o_ref, _ = reference.run(spec, q, k, v, g, beta, form="chunked")
    for name, fn in impls.items():
        if name == "sdpa":
            continue
        err = rel_rmse(fn(q, k, v, g, beta), o_ref)
        log({"kind": "precision", "impl": name, "T": 4096, "rel_l2_vs_fp64": err})


def bench(impls, cases):
    for B, T, H, HV in cases:
        q, k, v, g, beta = inputs(B, T, H, HV)
        floor = floor_ms(B, T, H, HV)
        for name, fn in impls.items():
            if name == "sdpa" and T > 40000:
                continue        # quadratic: minutes per call at 131k
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn(q, k, v, g, beta)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn(q, k, v, g, beta)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                ms = triton.testing.do_bench(lambda: fn(q, k, v, g, beta), warmup=50, rep=300,
                                             return_mode="median")
            except Exception as exc:  # noqa: BLE001
                log({"kind": "time", "impl": name, "case": [B, T, H, HV], "error": repr(exc)[:300]})
                continue
            log({"kind": "time", "impl": name, "case": [B, T, H, HV], "ms": ms, "tokens_per_s": B * T / ms * 1e3,
                 "peak_mib": peak, "first_call_s": first, "floor_ms": floor, "floor_fraction": floor / ms})
        del q, k, v, g, beta
        torch.cuda.empty_cache()


def table():
    rows = [json.loads(line) for line in open(ROWS)]
    times = [r for r in rows if r["kind"] == "time" and "ms" in r]
    by_case = {}
    for r in times:
        by_case.setdefault(tuple(r["case"]), {})[r["impl"]] = r
    print("\n| case (B,T,H,HV) | impl | ms | Mtok/s | peak MiB | first call s | floor ms | % of floor | vs FLA | vs FlashQLA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, impls in by_case.items():
        for name, r in impls.items():
            fla = impls.get("fla", {}).get("ms")
            fq = impls.get("flashqla", {}).get("ms")
            print(f"| {case} | {name} | {r['ms']:.3f} | {r['tokens_per_s'] / 1e6:.1f} | {r['peak_mib']:.0f} | "
                  f"{r['first_call_s']:.1f} | {r['floor_ms']:.3f} | {100 * r['floor_fraction']:.0f}% | "
                  f"{(fla / r['ms']) if fla else float('nan'):.2f}x | {(fq / r['ms']) if fq else float('nan'):.2f}x |")
    for r in rows:
        if r["kind"] in ("precision", "check", "first_call"):
            print(r)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="all")
    parser.add_argument("--impls", default="gdngen,fla,flashqla,sdpa")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    spec = load_spec("specs/gated_delta_rule.yaml")
    names = args.impls.split(",")
    cases = {"all": CASES, "long": [CASES[0], CASES[3]], "short": [CASES[1], CASES[2], CASES[4]]}[args.cases]
    if "gdngen" in names:
        from generated.gated_delta_rule import chunk_gated_delta_rule as ours
        q, k, v, g, beta = inputs(1, 8192, 16, 32)
        torch.cuda.synchronize()
        start = time.perf_counter()
        ours(q, k, v, g, beta)
        torch.cuda.synchronize()
        log({"kind": "first_call", "impl": "gdngen", "case": [1, 8192, 16, 32], "seconds": time.perf_counter() - start})
    if not args.skip_check:
        check_correctness(spec)
    impls = implementations(names)
    precision(spec, impls)
    bench(impls, cases)
    table()


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
