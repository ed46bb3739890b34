"""Experiment (#7): the per-channel output stage with its loops swapped, timed beside the generated one.

The generated kernel (templates/stages/output.py.j2 + _channel_chunk_scores.j2) runs levels outer,
key tiles inner, so every level reloads q/k and g (two float32 tiles) and a second pass over K loads
them again for the state term: ~22 tile loads per key tile. ncu at (4,8192,16,16) bf16: 987 us, 25%
occupancy, issue 33%, DRAM 23%, top stall long_scoreboard. Here: key tiles outer, q/k/g loaded once
per key tile, the state dot in the same loop, the levels inner (one gathered g_ref load each).
Correctness against the generated kernel's o on the same inputs, then do_bench per config; variants:
Y_BF16 rounds the decayed factors to bf16 before the level dots, LEVELS=0 leaves the levels out
(what the rest of the stage costs). Outcome (stop 19): keys outer 900 us (BK=32, BV=128, 4 warps)
against 1010; bf16 factors 863 us but 3.2e-3 from the float32 ones; without levels 338 us. The
generated kernel now has the keys-outer order (templates/stages/_channel_chunk_scores.j2).
SPLIT_SMALL (the small levels as batched 3D dots): 1109 us against the template's 899, not adopted
(measured with the full and small levels as two loops; the flag now selects the dot per level).

    python benchmarks/exp_channel_output.py [--case 4,8192,16,16]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from gdngen.bench import Case, make_inputs
from gdngen.spec import load_spec

OUT = os.environ.get("OUT", "bench_out")


@triton.jit
def _output_experiment(q, k, v, h, g_cum, o, scale, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, Y_BF16: tl.constexpr = False,
                       SPLIT_SMALL: tl.constexpr = False):
    """Key tiles outer, levels inner. Y_BF16: the decayed factors rounded to the input dtype before
    the level dots (FLA's choice). SPLIT_SMALL: the four levels inside 16-row blocks (G = 16..2, whose
    pairs all sit in the diagonal 16 x 16 blocks) as batched [BT/16, 16, BK] @ [BT/16, BK, 16] dots,
    not [BT, BT] products of which they keep a quarter (BT = 64) or less."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = i_b.to(tl.int64) * T
    i_chunk = i_b * tl.cdiv(T, BT) + i_t
    t0 = bos + i_t * BT
    T_chunk = T - i_t * BT
    NB: tl.constexpr = BT // 16
    FULL_LEVELS: tl.constexpr = LEVELS - 4 if SPLIT_SMALL else LEVELS
    o_t, o_v = tl.arange(0, BT), i_v * BV + tl.arange(0, BV)
    o_l = tl.arange(0, 16)
    m_t, m_v = o_t < T_chunk, o_v < V
    o_r = tl.minimum(o_t, T_chunk - 1)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    b_Ad = tl.zeros([NB, 16, 16], dtype=tl.float32)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_d = tl.zeros([BT], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        o_tk = (t0 * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_q = tl.load(q + o_tk, mask=m_tk, other=0.)
        b_k = tl.load(k + o_tk, mask=m_tk, other=0.)
        b_g = tl.load(g_cum + ((t0 + o_r[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_k[None, :], other=0.)
        p_h = h + (i_chunk.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.)
        b_o = tl.dot((b_q * tl.exp(b_g)).to(q.dtype.element_ty), b_h.to(q.dtype.element_ty), b_o,
                     input_precision=DOT_PRECISION)
        b_d += tl.sum(b_q.to(tl.float32) * b_k.to(tl.float32), axis=1)
        for i_l in range(LEVELS):
            s_g = LEVELS - i_l
            s_h = s_g - 1
            m_up = ((o_t >> s_h) & 1 == 1)[:, None]
            o_ref = tl.minimum(((o_t >> s_g) << s_g) + (1 << s_h), T_chunk - 1)
            b_gr = tl.load(g_cum + ((t0 + o_ref[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_k[None, :], other=0.)
            b_y = tl.where(m_up, b_q, b_k).to(tl.float32) * tl.exp(tl.where(m_up, b_g - b_gr, b_gr - b_g))
            if Y_BF16:
                b_y = b_y.to(q.dtype.element_ty)
            if i_l < FULL_LEVELS:
                b_S = tl.dot(b_y, tl.trans(b_y), input_precision=DOT_PRECISION)
                b_A += tl.where(((o_t[:, None] ^ o_t[None, :]) >> s_h) == 1, b_S, 0.)
            else:
                b_y3 = tl.reshape(b_y, [NB, 16, BK])
                b_S3 = tl.dot(b_y3, tl.permute(b_y3, (0, 2, 1)), input_precision=DOT_PRECISION)
                b_Ad += tl.where((((o_l[:, None] ^ o_l[None, :]) >> s_h) == 1)[None, :, :], b_S3, 0.)
    m_tv = m_t[:, None] & m_v[None, :]
    o_tv = (t0 * HV + i_hv) * V + o_t[:, None] * (HV * V) + o_v[None, :]
    b_v = tl.load(v + o_tv, mask=m_tv, other=0.)
    if SPLIT_SMALL:     # the diagonal 16 x 16 blocks (and the undecayed diagonal) by a batched dot
        b_A = tl.where(o_t[:, None] > o_t[None, :], b_A, 0.)
        b_Ad = tl.where((o_l[:, None] > o_l[None, :])[None, :, :], b_Ad,
                        tl.where((o_l[:, None] == o_l[None, :])[None, :, :], tl.reshape(b_d, [NB, 16])[:, :, None], 0.))
        b_od = tl.dot(b_Ad.to(v.dtype.element_ty), tl.reshape(b_v, [NB, 16, BV]), input_precision=DOT_PRECISION)
        b_o += tl.reshape(b_od, [BT, BV])
    else:
        b_A = tl.where(o_t[:, None] > o_t[None, :], b_A, tl.where(o_t[:, None] == o_t[None, :], b_d[:, None], 0.))
    b_o = (b_o + tl.dot(b_A.to(v.dtype.element_ty), b_v, input_precision=DOT_PRECISION)) * scale
    tl.store(o + o_tv, b_o.to(o.dtype.element_ty), mask=m_tv)

def log(row):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "exp_channel_output.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main():
    import importlib
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="4,8192,16,16")
    # kda's output stage loads A_qk from its wy stage since stop 20: only gla's still builds the levels
    parser.add_argument("--spec", default="gla", choices=["gla"])
    parser.add_argument("--only", default="", help="korder or split: time only that kernel's variants")
    a = parser.parse_args()
    B, T, H, HV = (int(x) for x in a.case.split(","))
    K = V = 128
    BT = 64
    spec = load_spec(f"specs/{a.spec}.yaml")
    mod = importlib.import_module(f"generated.{spec.name}")
    inp = make_inputs(spec, Case("exp", B, T, H, HV, K, V), torch.bfloat16, "cuda")
    fwd = getattr(mod, f"chunk_{spec.name}_fwd_states")(
        inp["q"], inp["k"], inp["v"], inp["g"], inp.get("beta"), initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=BT, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
        dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)
    q, k, g_cum, h, values = fwd["q"], fwd["k"], fwd["g_cum"], fwd["h"], fwd["values"]
    NT = fwd["NT"]
    scale = K ** -0.5
    precision = "tf32"
    ref = torch.empty(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    base = dict(BK=32, BV=128, num_warps=4, num_stages=1)      # the default since stop 19

    def generated(cfg):
        return lambda: mod._OUTPUT_KERNELS[BT][(triton.cdiv(V, cfg["BV"]), NT, B * HV)](
            q, k, values, h, g_cum, ref, None, None, scale, T, H=H, HV=HV, K=K, V=V, BT=BT,
            IS_VARLEN=False, DOT_PRECISION=precision, **cfg)

    generated(base)()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(generated(base), warmup=25, rep=200, return_mode="median")
    log({"kernel": "generated", "cfg": base, "us": 1e3 * ms})
    out = torch.empty_like(ref)
    variants = [("korder", dict(LEVELS=6)), ("korder", dict(LEVELS=6, Y_BF16=True)),
                ("korder", dict(LEVELS=0)), ("split", dict(LEVELS=6, SPLIT_SMALL=True))]
    if a.only:
        variants = [v for v in variants if v[0] == a.only]
    grid = [(bk, bv, w, 1) for bk in (32, 64) for bv in (64, 128) for w in (4, 8)]
    for (name, variant), (bk, bv, warps, stages) in ((v_, c_) for v_ in variants for c_ in grid):
        cfg = dict(BK=bk, BV=bv, num_warps=warps, num_stages=stages)

        def run(cfg=cfg, variant=variant):
            _output_experiment[(triton.cdiv(V, cfg["BV"]), NT, B * HV)](
                q, k, values, h, g_cum, out, scale, T, H=H, HV=HV, K=K, V=V, BT=BT,
                DOT_PRECISION=precision, **variant, **cfg)
        try:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = 1e3 * triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
            log({"kernel": name, "variant": variant, "cfg": cfg, "us": us, "rel_err_vs_generated": err})
        except Exception as exc:  # noqa: BLE001 - a config that fails is data too
            log({"kernel": name, "variant": variant, "cfg": cfg, "error": repr(exc)[:160]})


if __name__ == "__main__":
    main()
