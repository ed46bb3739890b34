"""The forward wy stage alone, by triangular-solve precision and warps (CUDA only; an experiment).

    python benchmarks/wy_variants.py [--cases "1,32768,32,32 8,2048,16,16"] [--out rows.jsonl]

The solve's small products (``_unit_lower_inverse`` and the block rows) are float32 ``tl.dot``s at
the kernel's ``SOLVE_PRECISION``: ``ieee`` (CUDA-core FMAs), ``tf32x3`` (three TF32 tensor-core
passes at about float32 accuracy) or ``tf32`` (one pass). Each variant runs the T path of
the wy kernel (what the forward takes with N*HV >= 32) on the same inputs; it reports the kernel's
median time and T's error against a float64 inverse of the same A (bf16 k, float32 beta and
decay), before T is rounded to bf16 (the stored T's own rounding is ~2e-3).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402


def inputs(B, T, H, HV, K=128, BT=64, regime="default"):
    """``default``: the benchmarks' gates; ``hard``: beta in (0, 2) (allow_neg_eigval) and almost no
    decay (g ~ -2.5e-3), where (I + A) is worst conditioned."""
    torch.manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(torch.bfloat16)
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda")) * (2 if regime == "hard" else 1)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + (6 if regime == "hard" else 2))
    g_cum = g.view(B, T // BT, BT, HV).cumsum(2).view(B, T, HV).contiguous()
    return k, beta, g_cum


def reference_error(k, beta, g_cum, tmat, HV, BT=64, chunks=64):
    """max over sampled chunks of ||T - inv(I + A)||_F / ||inv(I + A)||_F (float64)."""
    B, T, H, K = k.shape
    worst = 0.0
    for c in range(0, min(chunks, T // BT)):
        for hv in (0, HV - 1):
            sl = slice(c * BT, (c + 1) * BT)
            kc = k[0, sl, hv // (HV // H)].double()
            gc, bc = g_cum[0, sl, hv].double(), beta[0, sl, hv].double()
            A = torch.tril((kc @ kc.T) * bc[:, None] * torch.exp(gc[:, None] - gc[None, :]), -1)
            ref = torch.linalg.inv(torch.eye(BT, device=k.device, dtype=torch.float64) + A)
            got = tmat[0, sl, hv].double()
            worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1,32768,32,32 8,2048,16,16")
    parser.add_argument("--precisions", default="ieee,tf32x3,tf32")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--regime", default="default", choices=["default", "hard"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from generated import gated_delta_rule as module
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        K = V = 128
        BT = 64
        k, beta, g_cum = inputs(B, T, H, HV, K, BT, args.regime)
        NT = T // BT
        for precision in args.precisions.split(","):
            for warps in (int(w) for w in args.warps.split(",")):
                # float32 T for the error, bf16 (the forward's) for the time
                tmat = torch.full((B, T, HV, BT), float("nan"), device="cuda", dtype=torch.float32)

                def launch():
                    # (q and the scores A_qk: only a fused output's forward asks for them, STORE_AQK)
                    module._WY_KERNELS[BT][(NT, B * HV)](
                        None, k, None, None, beta, g_cum, tmat, None, None, None, None, None, T,
                        H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, STORE_WU=False, STORE_AQK=False, IS_VARLEN=False,
                        DOT_PRECISION="tf32", SOLVE_PRECISION=precision, num_warps=warps, num_stages=2)
                launch()
                torch.cuda.synchronize()
                err = reference_error(k, beta, g_cum, tmat, HV, BT)
                tmat = torch.empty((B, T, HV, BT), device="cuda", dtype=torch.bfloat16)
                us = triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median") * 1e3
                row = dict(case=text, regime=args.regime, precision=precision, warps=warps, us=us, t_rel_err=err)
                print(f"{text:16s} {args.regime:7s} {precision:7s} warps {warps}: {us:8.1f} us   T rel err {err:.2e}", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
