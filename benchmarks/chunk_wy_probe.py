"""Prototype: the chunk and wy backward stages in one program per (chunk, value head) (CUDA only).

    python benchmarks/chunk_wy_probe.py --cases "1,32768,32,32 8,2048,16,16" [--configs "4,2 8,2 4,1"] [--out rows.jsonl]

One real forward+backward records the two launches' arguments (the first time segment's at long T);
they are replayed (a) as the generated code launches them, chunk then wy, and (b) as one kernel that
runs every key tile of ``_chunk_bwd_tile`` then, after a CTA barrier, ``_wy_bwd_tile`` - so the wy
part reads dW, dK, dV_new and K back from L2 right after the chunk part wrote or read them, and one
launch goes. Both start from the same copies of the buffers; every output (dq, dk, dw, dv, dbeta,
dg_part) is compared bit for bit, then each variant's device time is the median of do_bench.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import generated.gated_delta_rule as gd  # noqa: E402
from generated.gated_delta_rule import _chunk_bwd_tile, _wy_bwd_tile  # noqa: E402
from gdngen import bench  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


@triton.jit
def _chunk_wy_bwd_kernel(
    q, k, values, h, dh, g_cum, do, dvals, dq, dk, dw, dg_part, dg_stride,
    v, beta, tmat, dv, dbeta, slot, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DELTA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    for i_k in tl.static_range((K + BK - 1) // BK):
        _chunk_bwd_tile(q, k, values, h, dh, g_cum, do, dvals, dq, dk, dw, dg_part, dg_stride, cu_seqlens,
                        chunk_indices, scale, T, i_k, i_t, i_bh, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
                        IS_VARLEN=IS_VARLEN, DELTA=DELTA, DOT_PRECISION=DOT_PRECISION)
    # the wy part reads back what this program's chunk part stored (dW, dK): bar.sync orders a CTA's
    # global writes before its reads
    tl.debug_barrier()
    _wy_bwd_tile(k, v, beta, g_cum, tmat, dw, dvals, dk, dv, dbeta, dg_part, dg_stride, slot, cu_seqlens,
                 chunk_indices, T, i_t, i_bh, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
                 IS_VARLEN=IS_VARLEN, DOT_PRECISION=DOT_PRECISION)


class Recorder:
    def __init__(self, launcher):
        self.launcher, self.calls = launcher, []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            # the inputs as this launch saw them (later launches overwrite some in place)
            self.calls.append((grid, clone_args(args), kwargs))
            return self.launcher[grid](*args, **kwargs)
        return call


def record(spec, case, device):
    chunk_rec, wy_rec = Recorder(gd._chunk_bwd_fast), Recorder(gd._wy_bwd_fast)
    gd._chunk_bwd_fast, gd._wy_bwd_fast = chunk_rec, wy_rec
    try:
        inputs = bench.make_inputs(spec, case, torch.bfloat16 if device == "cuda" else torch.float32, device, requires_grad=True)
        o = gd.chunk_gated_delta_rule(**inputs)[0]
        o.backward(torch.randn_like(o))
    finally:
        gd._chunk_bwd_fast, gd._wy_bwd_fast = chunk_rec.launcher, wy_rec.launcher
    return chunk_rec.calls[0], wy_rec.calls[0]


def clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1,32768,32,32 8,2048,16,16")
    parser.add_argument("--configs", default="4,2 8,2 4,1 8,1", help="fused num_warps,num_stages pairs")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: TRITON_INTERPRET=1, bitwise check only")
    args = parser.parse_args()
    spec = load_spec("specs/gated_delta_rule.yaml")
    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        (c_grid, c_args, c_kw), (w_grid, w_args, w_kw) = record(spec, bench.Case(text, B, T, H, HV), args.device)
        # chunk: q k values h dh g_cum do dvals dq dk dw dg_part dg_stride cu chunk_indices scale T
        # wy:    k v beta g_cum tmat dw dvals dk dv dbeta dg_part dg_stride slot cu chunk_indices T
        base = list(c_args) + [w_args[1], w_args[2], w_args[4], w_args[9], w_args[12]]

        def split_args(buf):
            ca = buf[:17]
            wa = [ca[1], buf[17], buf[18], ca[5], buf[19], ca[10], ca[7], ca[9], ca[7], buf[20], ca[11], ca[12],
                  buf[21], ca[13], ca[14], ca[16]]
            return ca, wa

        def run_split(buf):
            ca, wa = split_args(buf)
            gd._chunk_bwd_fast[c_grid](*ca, **c_kw)
            gd._wy_bwd_fast[w_grid](*wa, **w_kw)

        def fused_kwargs(warps, stages):
            kw = {n: c_kw[n] for n in ("H", "HV", "K", "V", "BT", "BK", "BV", "IS_VARLEN", "DELTA", "DOT_PRECISION")}
            return dict(kw, num_warps=warps, num_stages=stages)

        def run_fused(buf, warps, stages):
            ca, wa = split_args(buf)
            NT, BH = w_grid[0], w_grid[1]
            _chunk_wy_bwd_kernel[(NT, BH)](*ca[:13], wa[1], wa[2], wa[4], wa[8], wa[9], wa[12], ca[13], ca[14],
                                          ca[15], ca[16], **fused_kwargs(warps, stages))

        outputs = {"dq": 8, "dk": 9, "dw": 10, "dg_part": 11, "dv": 7, "dbeta": 20}
        ref = clone_args(base)
        run_split(ref)
        timed = args.device == "cuda"
        rows = []
        split_ms = triton.testing.do_bench(lambda: run_split(base), warmup=10, rep=200,
                                           return_mode="median") if timed else None
        rows.append({"case": text, "variant": "chunk+wy", "ms": split_ms, "grid": [list(c_grid), list(w_grid)],
                     "tiles": {k: v for k, v in c_kw.items() if k in ("BK", "BV", "num_warps", "num_stages")}})
        for pair in args.configs.split():
            warps, stages = (int(n) for n in pair.split(","))
            buf = clone_args(base)
            try:
                run_fused(buf, warps, stages)
            except Exception as exc:  # noqa: BLE001
                rows.append({"case": text, "variant": f"fused w{warps} s{stages}", "error": repr(exc)[:300]})
                continue
            equal = {name: bool(torch.equal(ref[i].nan_to_num(0.5, 1.5, -1.5), buf[i].nan_to_num(0.5, 1.5, -1.5)))
                     for name, i in outputs.items()}
            nans = {name: [int(ref[i].isnan().sum()), int(buf[i].isnan().sum())] for name, i in outputs.items()}
            diff = {name: float((ref[i].float() - buf[i].float()).abs().max()) for name, i in outputs.items()}
            ms = triton.testing.do_bench(lambda: run_fused(base, warps, stages), warmup=10, rep=200,
                                         return_mode="median") if timed else None
            rows.append({"case": text, "variant": f"fused w{warps} s{stages}", "ms": ms, "bitwise": equal,
                         "max_abs_diff": diff, "nans": nans})
        for row in rows:
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del base, ref, c_args, w_args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
