"""Does the backward's wy + chunk pair gain from L2 when run in T-slabs (wy slab s, then chunk slab s)? (stop 57)

Records the two Gluon stages' arguments from one training step, then replays them as CUDA graphs over S slabs
(each a contiguous run of chunks, B = 1), L2 cleared before each replay. Outputs compared with S = 1 bitwise.
    python benchmarks/results/2026-12-05-stop57-slab-probe.py --case 1,32768,32,32 --slabs "1 8 32 64 128" --out rows.jsonl
"""
import argparse, json, sys, statistics
import torch
sys.path.insert(0, ".")
import generated.gated_delta_rule as m
from benchmarks.profile_stages import step_fn
from gdngen.spec import load_spec

p = argparse.ArgumentParser()
p.add_argument("--case", default="1,32768,32,32"); p.add_argument("--slabs", default="1 8 32 64 128")
p.add_argument("--out", default="slab.jsonl")
a = p.parse_args()
case = [int(x) for x in a.case.split(",")]
B, T, H, HV = case
assert B == 1
calls = {}
wy0, ch0 = m._wy_bwd_gluon, m._chunk_bwd_gluon
def rec(name, fn):
    def wrapped(*args):
        calls[name] = args
        return fn(*args)
    return wrapped
m._wy_bwd_gluon, m._chunk_bwd_gluon = rec("wy", wy0), rec("chunk", ch0)
spec = load_spec("specs/gated_delta_rule.yaml")
step = step_fn(spec, m, case, backward=True)
step(); torch.cuda.synchronize()
m._wy_bwd_gluon, m._chunk_bwd_gluon = wy0, ch0
wy_args, ch_args = calls["wy"], calls["chunk"]
BT = 64
NC = T // BT

def cut(x, c0, c1):
    if not torch.is_tensor(x):
        return x
    if x.dim() == 4 and x.shape[0] == NC and x.shape[1] == HV:        # h, dh
        return x[c0:c1]
    if x.dim() == 4 and x.shape[1] == 1 and x.shape[2] == T:          # dg_part [NS, B, T, HV]
        return x[:, :, c0 * BT:c1 * BT]
    if x.shape[1] == T:
        return x[:, c0 * BT:c1 * BT]
    raise ValueError(f"unknown tensor shape {tuple(x.shape)}")

def slab_args(args, c0, c1, t_index):
    out = [cut(x, c0, c1) for x in args]
    out[t_index] = (c1 - c0) * BT
    return out

# T's position in each signature
WY_T = 14   # (k, v, beta, g_cum, tmat, h, dvals, dv, gs, dbeta, dg_part, dg_stride, slot, B, T, ...)
CH_T = 15   # (q, k, values, h, dh, g_cum, do, dv, dq, dk, gs, dg_part, dg_stride, scale, B, T, ...)
assert wy_args[WY_T] == T and ch_args[CH_T] == T, (wy_args[WY_T], ch_args[CH_T])
dvals0 = wy_args[6].clone()

def run(S):
    bounds = [(NC * i // S, NC * (i + 1) // S) for i in range(S)]
    for c0, c1 in bounds:
        wy0(*slab_args(wy_args, c0, c1, WY_T))
        ch0(*slab_args(ch_args, c0, c1, CH_T))

outs = {}
names = dict(dq=ch_args[8], dk=ch_args[9], dv=wy_args[7], gs=wy_args[8], dbeta=wy_args[9], dg=wy_args[10])
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
with open(a.out, "a") as f:
    for S in [int(s) for s in a.slabs.split()]:
        wy_args[6].copy_(dvals0)
        run(S); torch.cuda.synchronize()
        got = {n: t.clone() for n, t in names.items()}
        if not outs:
            outs = got
        same = {n: bool(torch.equal(got[n], outs[n])) for n in got}
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(S)
        torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
        with torch.cuda.graph(g):
            run(S)
        for _ in range(5):
            g.replay()
        times = []
        for _ in range(30):
            flush.zero_()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) * 1000)
        row = dict(case=a.case, slabs=S, us_median=round(statistics.median(times), 1), us_min=round(min(times), 1),
                   bitwise_vs_S1=same)
        f.write(json.dumps(row) + "\n"); f.flush()
        print(row, flush=True)
