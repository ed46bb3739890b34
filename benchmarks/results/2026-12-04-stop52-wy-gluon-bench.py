"""Stop 52 call 1 (run from the repository root): the Gluon forward wy prototype against the generated Triton wy kernel: T against float64, and timing."""
import importlib.util, sys, json, os, statistics, time, torch, triton
from gdngen.runtime.tma import key_tile_config
from gdngen.runtime.tiles import default_tiles
_spec = importlib.util.spec_from_file_location(
    "wy_gluon", os.path.join(os.path.dirname(os.path.abspath(__file__)), "2026-12-04-stop52-wy-gluon-prototype.py"))
wy_gluon = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wy_gluon)
import generated.gated_delta_rule as gdr

out = open(os.path.join(os.environ.get("OUT", "."), "wyg.jsonl"), "a")
def emit(row):
    print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()

def ref_T(k, beta, g, H, HV, rows):
    B, T_, _, K = k.shape; BT = 64
    kk = k[:, :rows].double().repeat_interleave(HV // H, dim=2)          # [B, rows, HV, K]
    n = rows // BT
    kc = kk.view(B, n, BT, HV, K).permute(0, 1, 3, 2, 4)                 # [B, n, HV, BT, K]
    bc = beta[:, :rows].double().view(B, n, BT, HV).permute(0, 1, 3, 2)
    gc = g[:, :rows].double().view(B, n, BT, HV).permute(0, 1, 3, 2)
    A = (kc @ kc.transpose(-1, -2)) * bc[..., :, None] * torch.exp(gc[..., :, None] - gc[..., None, :])
    A = torch.tril(A, -1)
    I = torch.eye(BT, dtype=torch.float64, device=k.device)
    Tm = torch.linalg.inv(I + A)                                          # [B, n, HV, BT, BT]
    return Tm.permute(0, 1, 3, 2, 4).reshape(B, rows, HV, BT)

def inputs(B, T, H, HV, seed=0, hard=False):
    K = 128; BT = 64; NT = T // BT
    torch.manual_seed(seed)
    if hard:
        keys = torch.nn.functional.normalize(torch.randn(B, T // 16, 1, H, K, device="cuda"), dim=-1)
        k = keys.expand(B, T // 16, 16, H, K).reshape(B, T, H, K).bfloat16().contiguous()
        beta = torch.full((B, T, HV), 1.9, device="cuda")
        g = torch.full((B, T, HV), -0.1, device="cuda").view(B, NT, BT, HV).cumsum(2).view(B, T, HV)
    else:
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
        beta = torch.rand(B, T, HV, device="cuda")
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3).view(B, NT, BT, HV).cumsum(2).view(B, T, HV)
    return k, beta.contiguous(), g.contiguous()

def triton_fn(k, beta, g, tmat, B, T, H, HV):
    K = V = 128; BT = 64; NT = T // BT
    cfg, k_desc = key_tile_config(default_tiles("wy", K=K, V=V, BT=BT, N=B, HV=HV, dtype=torch.bfloat16), k, H=H, K=K, BT=BT)
    def fn():
        gdr._WY_FAST[64][(NT, B * HV)](None, k, k_desc, None, beta, g, tmat, None, None, None, None, None, T,
            H=H, HV=HV, K=K, V=V, BT=BT, BV=64, STORE_WU=False, STORE_AQK=False, IS_VARLEN=False,
            DOT_PRECISION="tf32", SOLVE_PRECISION="fp16", **cfg)
    return fn

VARIANTS = [dict(programs_per_sm=p, stages=s, group_items=gi) for (p, s, gi) in
            [(2, 2, False), (3, 2, False), (3, 3, False), (4, 2, False), (2, 2, True)]]
cases = sys.argv[1].split() if len(sys.argv) > 1 else ["1,32768,32,32", "1,131072,16,32", "4,8192,16,32", "8,2048,16,16"]
# precision: ordinary and out-of-range data
for hard in (False, True):
    B, T, H, HV = (1, 4096, 16, 32)
    k, beta, g = inputs(B, T, H, HV, hard=hard)
    ref = ref_T(k, beta, g, H, HV, T)
    t_tr = torch.full((B, T, HV, 64), float("nan"), device="cuda", dtype=torch.float16)
    triton_fn(k, beta, g, t_tr, B, T, H, HV)()
    err = lambda t: ((t.double() - ref).norm() / ref.norm()).item()
    row = dict(probe="precision", hard=hard, triton_rel=err(t_tr), triton_nan=int(torch.isnan(t_tr).sum()))
    for v in VARIANTS:
        t_gl = torch.full_like(t_tr, float("nan"))
        wy_gluon.wy_fwd_gluon(k, beta, g, t_gl, B, T, H, HV, 128, 64, **v)
        torch.cuda.synchronize()
        row[str(tuple(v.values()))] = (err(t_gl), int(torch.isnan(t_gl).sum()), (t_gl.float() - t_tr.float()).abs().max().item())
    emit(row)
for case in cases:
    B, T, H, HV = map(int, case.split(","))
    k, beta, g = inputs(B, T, H, HV)
    fns = {}
    t_tr = torch.full((B, T, HV, 64), float("nan"), device="cuda", dtype=torch.float16)
    fns["triton"] = triton_fn(k, beta, g, t_tr, B, T, H, HV)
    tms = {"triton": t_tr}
    for v in VARIANTS:
        t_gl = torch.full_like(t_tr, float("nan"))
        name = "gluon" + str(tuple(v.values()))
        fns[name] = lambda t_gl=t_gl, v=v: wy_gluon.wy_fwd_gluon(k, beta, g, t_gl, B, T, H, HV, 128, 64, **v)
        tms[name] = t_gl
    for name, fn in fns.items():
        t0 = time.time(); fn(); torch.cuda.synchronize()
        emit(dict(case=case, impl=name, first_s=round(time.time() - t0, 2),
                  maxdiff=(tms[name].float() - t_tr.float()).abs().max().item(), nan=int(torch.isnan(tms[name]).sum())))
    times = {n: [] for n in fns}
    names = list(fns)
    for r in range(4):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(triton.testing.do_bench(fns[n], warmup=30, rep=150, return_mode="median") * 1000)
    for n in names:
        emit(dict(case=case, impl=n, us=round(statistics.median(times[n]), 1), rounds=[round(x, 1) for x in times[n]]))
