"""GatedDeltaNet layer benchmark on one GPU: gdngen.layers.GatedDeltaNet beside FLA's fla.layers.GatedDeltaNet.

Qwen3-Next's linear-attention shape by default: hidden 2048, 16 query/key heads and 32 value heads of
dim 128, B=4, T=8192, bf16.  One process:

1. a correctness check of the gdngen layer at a small shape against the same weights on the
   float64 reference path (forward output and every parameter gradient);
2. per implementation: first-call time (compile / autotune included), forward and forward+backward
   median times (triton.testing.do_bench), tokens/s and peak memory (total, and above the
   parameters and inputs);
3. the gdngen chunk op alone (forward+backward), to show how much of the layer is the GDN op.

Every row is appended to $OUT/layer.jsonl as soon as it is measured; a table is printed last.
``--profile``: per implementation, a torch.profiler table of the CUDA kernels of a few forward+backward
steps (time per step, sorted by total GPU time) to $OUT/layer_profile_<impl>.txt (and printed).

    python benchmarks/bench_layer.py [--impls gdngen,fla] [--B 4 --T 8192] [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")   # FLA's own Triton path

import torch
import triton

from gdngen.layers import GatedDeltaNet
from gdngen.selfcheck import rel_rmse

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
ROWS = os.path.join(OUT, "layer.jsonl")
GIB = 2 ** 30


def log(row: dict) -> None:
    with open(ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def make_layer(impl: str, args) -> torch.nn.Module:
    common = dict(hidden_size=args.hidden, num_heads=args.heads, num_v_heads=args.v_heads, head_dim=args.head_dim)
    if impl == "gdngen":
        layer = GatedDeltaNet(**common, conv_size=4, mode="chunk", layer_idx=0)
    elif impl == "fla":
        from fla.layers import GatedDeltaNet as FlaGatedDeltaNet
        layer = FlaGatedDeltaNet(**common, expand_v=1.0, mode="chunk", use_gate=True, use_short_conv=True,
                                 conv_size=4, layer_idx=0)
    else:
        raise ValueError(f"impl: unknown {impl!r}")
    return layer.to(device="cuda", dtype=torch.bfloat16)


def call(impl: str, layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out     # FLA returns (o, attentions, cache)


def check_small() -> None:
    """gdngen bf16 / fp32 layer vs the float64 reference path at B=2, T=300 (GVA, varlen-free)."""
    torch.manual_seed(0)
    opts = dict(hidden_size=256, num_heads=2, num_v_heads=4, head_dim=64, conv_bias=True, layer_idx=0)
    ref = GatedDeltaNet(**opts, kernels="reference").cuda().double()
    x64 = torch.randn(2, 300, 256, device="cuda", dtype=torch.float64)
    dy = torch.randn_like(x64)
    xr = x64.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * dy).sum().backward()
    for dtype in (torch.float32, torch.bfloat16):
        layer = GatedDeltaNet(**opts).cuda()
        layer.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
        layer = layer.to(dtype)
        x = x64.to(dtype).requires_grad_()
        y = layer(x)
        (y * dy.to(dtype)).sum().backward()
        ref_params = dict(ref.named_parameters())
        grads = {name: rel_rmse(p.grad, ref_params[name].grad) for name, p in layer.named_parameters()}
        log(dict(kind="check", dtype=str(dtype).split(".")[-1], out_rel_rmse=rel_rmse(y, y_ref),
                 dx_rel_rmse=rel_rmse(x.grad, xr.grad), worst_param_grad=max(grads.values()),
                 worst_param=max(grads, key=grads.get)))


def bench_impl(impl: str, args) -> dict | None:
    try:
        torch.manual_seed(0)
        layer = make_layer(impl, args)
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"{impl} unavailable: {exc!r}", flush=True)
        return None
    B, T = args.B, args.T
    x = torch.randn(B, T, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, args.hidden, device="cuda", dtype=torch.bfloat16)
    params = list(layer.parameters())

    def fwd():
        with torch.no_grad():
            call(impl, layer, x)

    def fwd_bwd():
        call(impl, layer, x).backward(dy)

    torch.cuda.synchronize()
    start = time.perf_counter()
    fwd_bwd()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start

    fwd_ms = triton.testing.do_bench(fwd, warmup=args.warmup_ms, rep=args.rep_ms)
    fwd_bwd_ms = triton.testing.do_bench(fwd_bwd, warmup=args.warmup_ms, rep=args.rep_ms, grad_to_none=[x] + params)

    if args.profile:
        try:
            profile_kernels(impl, fwd_bwd, [x] + params, steps=5)
        except Exception as exc:  # noqa: BLE001 - the timing rows matter more than the profile
            print(f"{impl} profile failed: {exc!r}", flush=True)

    for p in [x] + params:
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    row = dict(kind="layer", impl=impl, B=B, T=T, hidden=args.hidden, H=args.heads, HV=args.v_heads,
               K=args.head_dim, V=args.head_dim, dtype="bfloat16", params=sum(p.numel() for p in params),
               first_call_s=round(first_s, 2), fwd_ms=round(fwd_ms, 3), fwd_bwd_ms=round(fwd_bwd_ms, 3),
               fwd_tokens_per_s=round(B * T / fwd_ms * 1e3), fwd_bwd_tokens_per_s=round(B * T / fwd_bwd_ms * 1e3),
               peak_gib=round(peak / GIB, 3), peak_above_base_gib=round((peak - base) / GIB, 3),
               device=torch.cuda.get_device_name())
    log(row)
    del layer, x, dy, params
    torch.cuda.empty_cache()
    return row


def profile_kernels(impl: str, step, leaves, steps: int) -> None:
    """The CUDA kernels of ``steps`` forward+backward steps, per step, to $OUT/layer_profile_<impl>.txt."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for p in leaves:
                p.grad = None
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / steps / 1e3
    if not rows or total <= 0:            # another torch's event attributes: its own table
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40), flush=True)
        return
    lines = [f"{impl}: CUDA kernels of one forward+backward step ({steps} steps averaged), {total:.3f} ms in all",
             f"{'ms/step':>8} {'share':>6} {'calls/step':>10}  kernel"]
    for e in rows:
        ms = e.device_time_total / steps / 1e3
        lines.append(f"{ms:8.3f} {ms / total:6.1%} {e.count / steps:10.1f}  {e.key[:150]}")
    text = "\n".join(lines)
    path = os.path.join(OUT, f"layer_profile_{impl}.txt")
    with open(path, "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    log(dict(kind="profile", impl=impl, kernels_ms_per_step=round(total, 3), file=path,
             top=[dict(kernel=e.key[:120], ms=round(e.device_time_total / steps / 1e3, 3)) for e in rows[:12]]))


def bench_op_only(args) -> None:
    """The gdngen chunk op alone at the layer's shape (fused gate, beta sigmoid, L2 norm), forward+backward."""
    from generated.gated_delta_rule import chunk_gated_delta_rule
    B, T, H, HV, K = args.B, args.T, args.heads, args.v_heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16().requires_grad_()
    q, k, v, a, b = leaf(B, T, H, K), leaf(B, T, H, K), leaf(B, T, HV, K), leaf(B, T, HV), leaf(B, T, HV)
    A_log = torch.empty(HV, device="cuda").uniform_(1, 16).log().requires_grad_()
    dt_bias = torch.zeros(HV, device="cuda", requires_grad=True)
    do = torch.randn(B, T, HV, K, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        o, _ = chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        o.backward(do)
    fwd_bwd()
    ms = triton.testing.do_bench(fwd_bwd, warmup=args.warmup_ms, rep=args.rep_ms,
                                 grad_to_none=[q, k, v, a, b, A_log, dt_bias])
    log(dict(kind="op_only", impl="gdngen", B=B, T=T, H=H, HV=HV, K=K, fwd_bwd_ms=round(ms, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="gdngen,fla")
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--no-check", action="store_true", help="skip the small-shape correctness check")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel CUDA time of a forward+backward step (torch.profiler) to $OUT")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer needs a CUDA GPU")
    started = time.perf_counter()
    if not args.no_check:
        check_small()
    rows = [row for impl in args.impls.split(",") if (row := bench_impl(impl.strip(), args)) is not None]
    bench_op_only(args)

    print(f"\nGatedDeltaNet layer, B={args.B} T={args.T} hidden={args.hidden} H={args.heads} HV={args.v_heads} "
          f"K=V={args.head_dim} bf16 ({torch.cuda.get_device_name()})")
    print(f"{'impl':8} {'fwd ms':>8} {'fwd+bwd ms':>11} {'tok/s fwd+bwd':>14} {'peak GiB':>9} {'above base':>11}")
    for r in rows:
        print(f"{r['impl']:8} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:11.2f} {r['fwd_bwd_tokens_per_s']:14,d} "
              f"{r['peak_gib']:9.2f} {r['peak_above_base_gib']:11.2f}")
    if len(rows) == 2:
        a, b = rows
        print(f"{a['impl']} / {b['impl']}: fwd+bwd speed {b['fwd_bwd_ms'] / a['fwd_bwd_ms']:.2f}x, "
              f"peak memory {a['peak_gib'] / b['peak_gib']:.2f}x")
    print(f"total {time.perf_counter() - started:.0f} s; rows in {ROWS}")


if __name__ == "__main__":
    main()
