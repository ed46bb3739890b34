"""Where does the gated_delta_rule chunk forward's bf16 error come from? (issue #10's precision target)

CPU only. Runs the generated forward (generated/gated_delta_rule.py, the T path the H200 takes at
N * HV >= 32) under a bf16-faithful Triton interpreter, once as generated and once per variant in
which ONE 16-bit rounding of an intermediate is removed, and reports the relative RMS error of ``o``
and of the final state against the float64 chunked reference (gdngen.reference.run).

The interpreter patch (tests/test_bf16_emulation_cpu.py's fixture, as a function here): ``tl.dot``
on bf16 operands upcasts to float32 and accumulates in float32 (the tensor cores), float32 -> bf16
casts round to nearest even (``cvt.rn``). Added here: a float32 x float32 dot launched with
``input_precision="tf32"`` (what the kernels' DOT_PRECISION is for bf16 inputs, so what a float32
operand meets on the H200) has its operands truncated to TF32's 10 explicit mantissa bits
(``--tf32 round`` rounds instead; ``--tf32 off`` makes them exact float32, as tf32x3 / ieee would).

Each variant is a scratch copy of generated/gated_delta_rule.py with string replacements (each
asserted to apply exactly the expected number of times), written to a temporary directory and
imported under its own name; the torch.library op names get a per-variant namespace. Nothing under
generated/ or templates/ is changed. The variants are listed in VARIANTS (what each replaces is in
its ``edits``); "extra bytes" is the added HBM traffic of the forward at (1, 32768, 32, 32),
K = V = 128, bf16, from the buffers a variant widens to float32 (register-only roundings add none,
but their dot runs as TF32 instead of bf16: half the tensor-core rate on that dot).

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/precision_study.py --T 2048

``--gpu`` (no interpreter, no patch): the same variants compiled on the GPU, on bench_prefill's
precision case (inputs(1, 4096, 16, 32, seed=2), K = V = 128: the T path by itself), and with
``--time`` each variant's forward timed at (1, 32768, 32, 32) (triton.testing.do_bench, median):

    PYTHONPATH=$PWD python benchmarks/precision_study.py --gpu --time --md $OUT/precision_study_h200.md
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

if "--gpu" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gdngen import reference  # noqa: E402
import gdngen.runtime.tiles  # noqa: E402,F401  (the package re-exports a function named tiles)
tiles_module = sys.modules["gdngen.runtime.tiles"]
from gdngen.selfcheck import rel_rmse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated" / "gated_delta_rule.py"
RESULTS = ROOT / "benchmarks" / "results" / "precision_study_cpu.md"


from gdngen.bf16_emulation import patch_bf16_interpreter  # noqa: E402


# ---------------------------------------------------------------- the variants (source edits)
# Each edit: (old, new, expected count). The T path (STORE_WU=False) only: the H200's case.
STATE_KS_DOT = "tl.dot(b_k, b_h.to(b_k.dtype), input_precision=DOT_PRECISION) * b_bw[:, None]"
STATE_TX_DOT = "b_v = tl.dot(b_T, b_x.to(b_T.dtype), input_precision=DOT_PRECISION)"
STATE_UPDATE_DOT = "b_h += tl.dot(tl.trans(b_k), b_v.to(b_k.dtype), input_precision=DOT_PRECISION)"
OUTPUT_QS_DOT = "b_o += tl.dot(b_q, b_h.to(b_q.dtype), input_precision=DOT_PRECISION)"
# (the newline and four spaces: the output stage's line, not the state pass's fused-output copy of it)
OUTPUT_PV_DOT = "\n    b_o = (b_o + tl.dot(b_A.to(v.dtype.element_ty), b_v.to(v.dtype.element_ty), input_precision=DOT_PRECISION)) * scale"
TMAT_ALLOC = "tmat = torch.empty(B, T, HV, BT, device=q.device, dtype=tmat_dtype or k.dtype) if not wu_in_memory else None"
H_ALLOC = "h = None if fused_output else torch.empty(state_rows, HV, K, V, device=q.device, dtype=k.dtype)"
VNEW_ALLOC = "values = None if fused_output else torch.empty_like(v)     # V_new, written by the state pass"
FWD_PRECISION = "BT, varlen, precision = chunk_size, cu_seqlens is not None, dot_precision(q.dtype)"
STATES_PRECISION = "    precision = dot_precision(q.dtype)\n"
BF16_F32 = ".to(tl.bfloat16).to(tl.float32)"      # round to bf16 as before, then feed a float32 dot

# Every rounding point of the T-path forward (k, q, v are bf16 inputs: exact; the gates are applied
# to dot outputs as row factors, so no gated q / k tile is ever rounded):
#   T     wy stores T = (I + A)^-1 in k's dtype; the state pass loads it for V_new = T X
#   X     state pass: X = diag(beta) V - diag(beta decay) (K S) rounded for the T X dot
#   S_ks  state pass: the running state S rounded for the K S dot (same chunk)
#   Vnew  state pass stores V_new in v's dtype; the output stage's P V_new dot reads it
#   Vupd  state pass: V_new * decay rounded for the state update K^T V_new
#   h     state pass stores the chunk-start states in k's dtype; the output's Q S dot reads them
#   P     output: the causal scores (Q K^T * decay) rounded for the P V_new dot
#   o     output stored in v's dtype (the floor row)
POINTS = ("T", "X", "S_ks", "Vnew", "Vupd", "h", "P")


def edits_for(keep):
    """Source edits keeping the rounding points in ``keep`` in float32 (the rest as generated)."""
    keep = set(keep)
    assert keep <= set(POINTS), keep
    edits = []
    if "T" in keep:
        edits.append((TMAT_ALLOC, TMAT_ALLOC.replace("dtype=tmat_dtype or k.dtype", "dtype=torch.float32"), 1))
    if "T" in keep or "X" in keep:
        # both operands float32 (a dot needs equal operand dtypes); the one not kept is rounded first
        t_expr = "b_T.to(tl.float32)"                       # float32 storage, or a bf16 -> float32 upcast (exact)
        x_expr = "b_x" if "X" in keep else "b_x" + BF16_F32
        edits.append((STATE_TX_DOT, f"b_v = tl.dot({t_expr}, {x_expr}, input_precision=DOT_PRECISION)", 1))
    if "S_ks" in keep:
        edits.append((STATE_KS_DOT, "tl.dot(b_k.to(tl.float32), b_h, input_precision=DOT_PRECISION) * b_bw[:, None]", 1))
    if "Vupd" in keep:
        edits.append((STATE_UPDATE_DOT, "b_h += tl.dot(tl.trans(b_k).to(tl.float32), b_v, input_precision=DOT_PRECISION)", 1))
    if "h" in keep:
        edits.append((H_ALLOC, H_ALLOC.replace("dtype=k.dtype", "dtype=torch.float32"), 1))
        edits.append((OUTPUT_QS_DOT, "b_o += tl.dot(b_q.to(tl.float32), b_h, input_precision=DOT_PRECISION)", 1))
    if "Vnew" in keep:
        edits.append((VNEW_ALLOC, VNEW_ALLOC.replace("torch.empty_like(v)", "torch.empty_like(v, dtype=torch.float32)"), 1))
    if "Vnew" in keep or "P" in keep:
        p_expr = "b_A" if "P" in keep else "b_A" + BF16_F32
        edits.append((OUTPUT_PV_DOT, f"\n    b_o = (b_o + tl.dot({p_expr}, b_v.to(tl.float32), input_precision=DOT_PRECISION)) * scale", 1))
    return edits


# bf16x2 splits: the float32 operand x as hi = bf16(x) plus lo = bf16(x - hi) (~16 mantissa bits),
# two or three bf16 dots instead of one TF32 dot (the same tensor-core time as TF32 on Hopper, no
# TF32 truncation, no float32 operand tile in shared memory)
SPLIT_X = [(STATE_TX_DOT,
            "b_x_hi = b_x.to(b_T.dtype)\n"
            "            b_x_lo = (b_x - b_x_hi.to(tl.float32)).to(b_T.dtype)\n"
            "            b_v = tl.dot(b_T, b_x_hi, input_precision=DOT_PRECISION) + tl.dot(b_T, b_x_lo, input_precision=DOT_PRECISION)", 1)]
SPLIT_P = [(OUTPUT_PV_DOT,
            "\n    b_A_hi = b_A.to(b_v.dtype)\n"
            "    b_A_lo = (b_A - b_A_hi.to(tl.float32)).to(b_v.dtype)\n"
            "    b_o = (b_o + tl.dot(b_A_hi, b_v, input_precision=DOT_PRECISION) + tl.dot(b_A_lo, b_v, input_precision=DOT_PRECISION)) * scale", 1)]
# V_new float32 in memory, P and V_new both split: P_hi V_hi + P_lo V_hi + P_hi V_lo (3 bf16 dots)
SPLIT_PV = [(VNEW_ALLOC, VNEW_ALLOC.replace("torch.empty_like(v)", "torch.empty_like(v, dtype=torch.float32)"), 1),
            (OUTPUT_PV_DOT,
             "\n    b_A_hi = b_A.to(tl.bfloat16)\n"
             "    b_A_lo = (b_A - b_A_hi.to(tl.float32)).to(tl.bfloat16)\n"
             "    b_v_hi = b_v.to(tl.bfloat16)\n"
             "    b_v_lo = (b_v - b_v_hi.to(tl.float32)).to(tl.bfloat16)\n"
             "    b_o = (b_o + tl.dot(b_A_hi, b_v_hi, input_precision=DOT_PRECISION) + tl.dot(b_A_lo, b_v_hi, input_precision=DOT_PRECISION)"
             " + tl.dot(b_A_hi, b_v_lo, input_precision=DOT_PRECISION)) * scale", 1)]

# the state update's V_new operand split too (one more bf16 dot on the state pass's sequential chain)
SPLIT_VUPD = [(STATE_UPDATE_DOT,
               "b_v_hi = b_v.to(b_k.dtype)\n"
               "        b_v_lo = (b_v - b_v_hi.to(tl.float32)).to(b_k.dtype)\n"
               "        b_h += tl.dot(tl.trans(b_k), b_v_hi, input_precision=DOT_PRECISION) + tl.dot(tl.trans(b_k), b_v_lo, input_precision=DOT_PRECISION)", 1)]

# V_new not read from memory: the output stage recomputes it in float32 from v, T, beta, the decay and
# the chunk-start state it loads anyway (X = diag(beta) V - diag(beta decay) (K h), V_new = T X with
# X split), the P V_new dot split in 3 bf16 dots. h is the stored bf16 state, which is what the state
# pass's K S dot rounds S to, so the recomputed V_new is the state pass's unrounded one (up to the
# float32 summation order). The state pass is unchanged (its V_new store would go: not counted here).
OUTPUT_SIGNATURE = ("    g_cum,          # [B, T, HV] float32 chunk-local cumsum of the log-decay\n"
                    "    o,              # [B, T, HV, V] out\n")
# (with the start of the next line: the output stage loading the values, no other kernel)
OUTPUT_V_LOAD = "    b_v = tl.load(v + o_tv, mask=m_tv, other=0.)\n    b_o = b_o * tl.exp2(b_g"
RECOMPUTE_VNEW = [
    (OUTPUT_SIGNATURE, OUTPUT_SIGNATURE.replace("    o,", "    tmat,\n    beta_act,\n    o,"), 1),
    ("    b_A = tl.zeros([BT, BT], dtype=tl.float32)\n    # BV >= 64",
     "    b_A = tl.zeros([BT, BT], dtype=tl.float32)\n    b_kh = tl.zeros([BT, BV], dtype=tl.float32)\n    # BV >= 64", 1),
    (OUTPUT_QS_DOT, OUTPUT_QS_DOT + "\n        b_kh += tl.dot(b_k, b_h.to(b_k.dtype), input_precision=DOT_PRECISION)", 1),
    (OUTPUT_V_LOAD,
     "    b_v = tl.load(v + o_tv, mask=m_tv, other=0.).to(tl.float32)\n"
     "    b_beta = tl.load(beta_act + (t0 + o_t) * HV + i_hv, mask=m_t, other=0.)\n"
     "    b_x = b_v * b_beta[:, None] - b_kh * (b_beta * tl.exp2(b_g * 1.4426950408889634))[:, None]\n"
     "    b_T = tl.load(tmat + (t0 * HV + i_hv) * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0.)\n"
     "    b_x_hi = b_x.to(b_T.dtype)\n"
     "    b_x_lo = (b_x - b_x_hi.to(tl.float32)).to(b_T.dtype)\n"
     "    b_v = tl.dot(b_T, b_x_hi, input_precision=DOT_PRECISION) + tl.dot(b_T, b_x_lo, input_precision=DOT_PRECISION)\n"
     "    b_o = b_o * tl.exp2(b_g", 1),
    (OUTPUT_PV_DOT,
     "\n    b_A_hi = b_A.to(tl.bfloat16)\n"
     "    b_A_lo = (b_A - b_A_hi.to(tl.float32)).to(tl.bfloat16)\n"
     "    b_v_hi = b_v.to(tl.bfloat16)\n"
     "    b_v_lo = (b_v - b_v_hi.to(tl.float32)).to(tl.bfloat16)\n"
     "    b_o = (b_o + tl.dot(b_A_hi, b_v_hi, input_precision=DOT_PRECISION) + tl.dot(b_A_lo, b_v_hi, input_precision=DOT_PRECISION)"
     " + tl.dot(b_A_hi, b_v_lo, input_precision=DOT_PRECISION)) * scale", 1),
    ("            q, k, values, h, g_cum, o, cu_seqlens, chunk_indices, scale, T,",
     '            q, k, v, h, g_cum, fwd["tmat"], fwd["beta_act"], o, cu_seqlens, chunk_indices, scale, T,', 1),
]

IEEE = [(FWD_PRECISION, FWD_PRECISION.replace("dot_precision(q.dtype)", '"ieee"'), 2),   # forward and backward
        (STATES_PRECISION, '    precision = "ieee"\n', 1)]

# float16 instead of bf16 for the intra-chunk path (11 significant bits instead of 8, the same tensor-core rate
# and bytes): T stored in float16, so the state pass's T X dot rounds X to it (STATE_TX_DOT rounds X to T's
# dtype); V_new stored in float16; the output's P V_new dot on float16 operands.
F16_TX = [(TMAT_ALLOC, TMAT_ALLOC.replace("dtype=tmat_dtype or k.dtype", "dtype=torch.float16"), 1)]
F16_PV = [(VNEW_ALLOC, VNEW_ALLOC.replace("torch.empty_like(v)", "torch.empty_like(v, dtype=torch.float16)"), 1),
          (OUTPUT_PV_DOT, "\n    b_o = (b_o + tl.dot(b_A.to(tl.float16), b_v.to(tl.float16), input_precision=DOT_PRECISION)) * scale", 1)]
F16_VUPD = [(STATE_UPDATE_DOT, "b_h += tl.dot(tl.trans(b_k).to(tl.float16), b_v.to(tl.float16), input_precision=DOT_PRECISION)", 1)]

# (name, kept points, extra edits, what it means)
VARIANTS = [("as generated", (), [], "every intermediate as the kernels round it today")]
VARIANTS += [(f"{p} f32", (p,), [], f"only {p} kept in float32 (float32 dots meet TF32)") for p in POINTS]
VARIANTS += [
    ("X+P f32", ("X", "P"), [], "the two register-only roundings removed (0 bytes; two dots at TF32)"),
    ("X+Vnew+P f32", ("X", "Vnew", "P"), [], "the three big ones: X, V_new in memory, P"),
    ("X+P split", (), SPLIT_X + SPLIT_P, "X and P as bf16 hi+lo pairs: 2 bf16 dots each, no TF32"),
    ("X+Vnew+P split", (), SPLIT_X + SPLIT_PV, "as above, V_new float32 in memory, P V_new as 3 bf16 dots"),
    ("X+Vnew+P+Vupd split", (), SPLIT_X + SPLIT_PV + SPLIT_VUPD, "as above, and the state update's V_new split (final state)"),
    ("Vnew recomputed in output", (), RECOMPUTE_VNEW,
     "output forms V_new = T X from v, T, h in float32 (X split), P V_new 3 bf16 dots; state pass as generated"),
    ("Vnew recomputed + state X/Vupd split", (), RECOMPUTE_VNEW + SPLIT_X + SPLIT_VUPD,
     "as above, and the state pass's X and update operand split (its V_new store would go)"),
    ("T+X f16", (), F16_TX, "T in memory and X as float16 (the T X dot on float16 operands)"),
    ("T+X+Vnew+P f16", (), F16_TX + F16_PV, "as above, V_new in memory and P V_new as float16 too"),
    ("T+X+Vnew+P+Vupd f16", (), F16_TX + F16_PV + F16_VUPD, "as above, and the state update's operands float16"),
    ("T+X f32", ("T", "X"), [], "the whole V_new = T X product in float32"),
    ("T+X+Vnew+P f32", ("T", "X", "Vnew", "P"), [], "the intra-chunk path in float32"),
    ("all f32 (TF32 dots)", POINTS, [], "every rounding point float32; float32 dots at TF32"),
    ("all f32 (ieee dots)", POINTS, IEEE, "every rounding point float32; float32 dots exact"),
]


def scratch_module(name, edits, directory):
    """generated/gated_delta_rule.py with ``edits`` applied, imported as ``name``."""
    source = GENERATED.read_text()
    for old, new, count in edits:
        found = source.count(old)
        assert found == count, (name, old, found, count)
        source = source.replace(old, new)
    found = source.count('"gdngen::')
    assert found >= 2, found
    source = source.replace('"gdngen::', f'"gdngen_{name}::')   # own torch.library namespace per copy
    path = Path(directory) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- memory traffic at the H200 case
def extra_bytes(keep, B=1, T=32768, H=32, HV=32, K=128, V=128, BT=64):
    """Added HBM bytes of one forward when the kept buffers are float32 instead of bf16 (2 more bytes
    per element per write and per read). Reads: T by every V tile of the state pass; V_new and h
    once by the output stage (each program reads its V tile of them)."""
    n_state_v_tiles = -(-V // tiles_module.tiles("gated_delta_rule", "state", K=K, V=V, BT=BT, N=B, HV=HV,
                                                 dtype=torch.bfloat16, H=H, T=T)["BV"])
    per_buffer = {
        "T": B * T * HV * BT * (1 + n_state_v_tiles),          # written by wy, read by each state V tile
        "Vnew": B * T * HV * V * 2,                             # written by state, read by output
        "h": B * (T // BT) * HV * K * V * 2,                    # written by state, read by output
    }
    return sum(2 * per_buffer[p] for p in keep if p in per_buffer)


def recompute_bytes(B=1, T=32768, H=32, HV=32, K=128, V=128, BT=64):
    """V_new recomputed by the output stage: its bf16 write by the state pass goes, the output reads v
    instead of V_new (same bytes) plus T once per output V tile (beta: negligible)."""
    n_output_v_tiles = -(-V // tiles_module.tiles("gated_delta_rule", "output", K=K, V=V, BT=BT, N=B, HV=HV,
                                                  dtype=torch.bfloat16, H=H, T=T)["BV"])
    return B * T * HV * BT * 2 * n_output_v_tiles - B * T * HV * V * 2


def baseline_bytes(B=1, T=32768, H=32, HV=32, K=128, V=128, BT=64):
    """HBM bytes of today's forward (bf16 buffers, T path), for scale: inputs read, buffers written and read."""
    n_state_v_tiles = -(-V // tiles_module.tiles("gated_delta_rule", "state", K=K, V=V, BT=BT, N=B, HV=HV,
                                                 dtype=torch.bfloat16, H=H, T=T)["BV"])
    qk = B * T * H * K * 2
    vv = B * T * HV * V * 2
    tmat = B * T * HV * BT * 2
    h = B * (T // BT) * HV * K * V * 2
    wy = qk + tmat                                 # k in, T out (gates: negligible)
    state = n_state_v_tiles * (qk + tmat) + vv + vv + h    # k and T per V tile, v in, V_new out, h out
    output = 2 * qk + h + vv + vv                  # q, k, h, V_new in, o out
    return wy + state + output


# ---------------------------------------------------------------- the run
def make_inputs(B, T, H, HV, K, V, seed, gate_shift=2.0):
    """benchmarks/bench_prefill.py's inputs (CPU generator: other numbers, same distribution).
    ``gate_shift``: g = logsigmoid(randn + gate_shift); bench_prefill's 2.0 decays the state by
    ~e^-10 over a 64-token chunk (short memory: inter-chunk roundings barely reach o); larger
    shifts keep more of the state across chunks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + gate_shift)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    return q, k, v, g, beta


def bench_prefill_inputs(B, T, H, HV, K, V, seed):
    """benchmarks/bench_prefill.py's inputs() on the GPU, bit for bit (same generator calls)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device="cuda", generator=gen).to(torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=gen))
    return q, k, v, g, beta


def forward(module, q, k, v, g, beta):
    return module.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=None, output_final_state=True,
        cu_seqlens=None, chunk_size=64, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=1)
    parser.add_argument("--HV", type=int, default=2)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--gate-shift", type=float, default=2.0, help="g = logsigmoid(randn + shift)")
    parser.add_argument("--tf32", choices=("truncate", "round", "off"), default="truncate",
                        help="how a float32 dot at input_precision tf32 rounds its operands")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--gpu", action="store_true", help="compile on the GPU: bench_prefill's (1,4096,16,32) case")
    parser.add_argument("--time", action="store_true", help="with --gpu: also time each forward at (1,32768,32,32)")
    parser.add_argument("--md", default="", help="with --gpu: append the table to this file")
    parser.add_argument("--no-write", action="store_true", help=f"do not append to {RESULTS.name}")
    args = parser.parse_args()
    if args.gpu:
        assert torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", "--gpu needs CUDA, compiled"
        B, T, H, HV, K = 1, 4096, 16, 32, 128
        V = K
        q, k, v, g, beta = bench_prefill_inputs(B, T, H, HV, K, V, seed=2)
        big = bench_prefill_inputs(1, 32768, 32, 32, K, V, seed=0) if args.time else None
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available(), "CPU interpreter only"
        B, T, H, HV, K = 1, args.T, args.H, args.HV, args.K
        V = K
        q, k, v, g, beta = make_inputs(B, T, H, HV, K, V, args.seed, args.gate_shift)
        big = None
    import generated.gated_delta_rule as gdn
    o_ref, ht_ref = reference.run(gdn.SPEC, q, k, v, g, beta, form="chunked", output_final_state=True)
    floor = rel_rmse(o_ref.to(torch.bfloat16), o_ref)

    undo = (lambda: None) if args.gpu else patch_bf16_interpreter(args.tf32)
    rows = []
    try:
        # the T path, as the H200 takes it at N * HV >= 32 (store_wu would pick W/U at N * HV = 2)
        # the output in its own stage, as at (1, 32768, 32, 32): the public op's short no-grad calls
        # fuse it into the state pass (tiles.fused_output), which the edits below do not cover
        with tiles_module.override("gated_delta_rule", "store_wu", value=False), \
                tiles_module.override("gated_delta_rule", "fused_output", value=False), \
                tempfile.TemporaryDirectory() as scratch:
            wanted = [name for name in args.only.split(",") if name]
            for i, (name, keep, extra, meaning) in enumerate(VARIANTS):
                if wanted and name not in wanted:
                    continue
                module = scratch_module(f"gdn_precision_variant_{i}", edits_for(keep) + extra, scratch)
                start = time.perf_counter()
                try:
                    o, ht = forward(module, q, k, v, g, beta)
                except Exception as exc:  # noqa: BLE001 - on the GPU a variant may not compile (shared memory): report, go on
                    if not args.gpu:
                        raise
                    print(f"{name:24s} FAILED: {exc!r}"[:400], flush=True)
                    continue
                seconds = time.perf_counter() - start
                if i == 0:   # the scratch copy is the shipped forward: the public op gives the same bits
                    o_pub, ht_pub = gdn.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
                    assert torch.equal(o_pub, o) and torch.equal(ht_pub, ht), "scratch baseline != public op"
                if big is not None:
                    import triton
                    forward(module, *big)
                    row_ms = triton.testing.do_bench(lambda: forward(module, *big), warmup=25, rep=200,
                                                     return_mode="median")
                widened = set(keep) | ({"Vnew"} if any(edit in extra for edit in SPLIT_PV) else set())
                extra_mb = extra_bytes(widened) / 1e6
                if RECOMPUTE_VNEW[0] in extra:
                    extra_mb = recompute_bytes() / 1e6
                row = dict(variant=name, o=rel_rmse(o, o_ref), ht=rel_rmse(ht, ht_ref),
                           extra_mb=extra_mb, seconds=seconds, meaning=meaning,
                           ms=row_ms if big is not None else None)
                rows.append(row)
                print(f"{name:24s} o {row['o']:.3e}  ht {row['ht']:.3e}  +{row['extra_mb']:7.0f} MB  "
                      f"({seconds:.0f} s)" + (f"  32k fwd {row['ms']:.3f} ms" if row["ms"] is not None else ""),
                      flush=True)
    finally:
        undo()

    if args.gpu:
        lines = ["\n## H200: bench_prefill's precision case (1,4096,16,32), K=V=128, seed 2, compiled\n",
                 "`PYTHONPATH=$PWD python benchmarks/precision_study.py --gpu" + (" --time" if args.time else "") + "`\n",
                 f"Floor (float64 reference rounded once to bf16): o {floor:.3e}.\n",
                 "| variant | rel_rmse o | rel_rmse final state | extra bytes at 32k | fwd ms at (1,32768,32,32) |",
                 "|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['o']:.3e} | {r['ht']:.3e} | {r['extra_mb']:.0f} MB | "
                  + (f"{r['ms']:.3f}" if r["ms"] is not None else "-") + " |" for r in rows]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.md:
            with open(args.md, "a") as f:
                f.write(text)
        return
    command = (f"PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/precision_study.py --T {T} --H {H} "
               f"--HV {HV} --K {K} --seed {args.seed} --gate-shift {args.gate_shift} --tf32 {args.tf32}" + (f" --only '{args.only}'" if args.only else ""))
    lines = [f"\n## B=1, T={T}, H={H}, HV={HV}, K=V={K}, seed {args.seed}, g = logsigmoid(randn + {args.gate_shift}), chunk 64, T path, TF32 operands: {args.tf32}\n",
             f"`{command}`\n",
             f"Floor (float64 reference rounded once to bf16): o {floor:.3e}. "
             f"Today's forward at (1,32768,32,32) moves ~{baseline_bytes() / 1e6:.0f} MB (estimate).\n",
             "| variant | rel_rmse o | rel_rmse final state | extra bytes at (1,32768,32,32) | what changes |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['o']:.3e} | {r['ht']:.3e} | {r['extra_mb']:.0f} MB | {r['meaning']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text("# gated_delta_rule bf16 forward error by intermediate (CPU, bf16-faithful interpreter)\n\n"
                               "Written by benchmarks/precision_study.py; see its docstring for the variants.\n")
        with RESULTS.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
