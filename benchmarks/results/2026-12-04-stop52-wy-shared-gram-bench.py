"""Stop 52: the forward wy kernel with the key Gram shared by a head group's value heads (one program per key
head) against one program per value head: T bitwise, interleaved do_bench. Run from the repository root.

Call 6 ran this against a hand-made copy of the rendering (its per-key-head kernel the prototype of the template's
G_SHARE); since b0de050 the generated kernel takes G_SHARE itself, which this version launches."""
import importlib.util, sys, json, os, statistics, torch, triton
sys.path.insert(0, os.getcwd())
from gdngen.runtime.tma import key_tile_config
from gdngen.runtime.tiles import default_tiles
import generated.gated_delta_rule as m
out = open(os.path.join(os.environ.get("OUT", "."), "wys.jsonl"), "a")
for case in sys.argv[1:]:
    B, T, H, HV = map(int, case.split(",")); K = V = 128; BT = 64; NT = T // BT; G = HV // H
    torch.manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    beta = torch.rand(B, T, HV, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3).view(B, NT, BT, HV).cumsum(2).view(B, T, HV)
    cfg, k_desc = key_tile_config(default_tiles("wy", K=K, V=V, BT=BT, N=B, HV=HV, dtype=torch.bfloat16), k, H=H, K=K, BT=BT)
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=64, STORE_WU=False, STORE_AQK=False, IS_VARLEN=False, DOT_PRECISION="tf32", SOLVE_PRECISION="fp16")
    fns, outs = {}, {}
    def mk(name, warps):
        tmat = torch.full((B, T, HV, BT), float("nan"), device="cuda", dtype=torch.float16)
        c = dict(cfg, num_warps=warps)
        if name == "head":
            f = lambda: m._WY_FAST[64][(NT, B * HV)](None, k, k_desc, None, beta, g, tmat, None, None, None, None, None, T, **common, **c)
        else:
            f = lambda: m._WY_FAST[64][(NT, B * H)](None, k, k_desc, None, beta, g, tmat, None, None, None, None, None, T, **common, **c, G_SHARE=G)
        f(); torch.cuda.synchronize()
        fns[f"{name}{warps}"] = f; outs[f"{name}{warps}"] = tmat
    mk("head", 1); mk("share", 1); mk("share", 2)
    ref = outs["head1"]
    for n, t in outs.items():
        print(case, n, "bitwise" if torch.equal(t, ref) else (t.float() - ref.float()).abs().max().item(), "nan", torch.isnan(t).sum().item(), flush=True)
    times = {n: [] for n in fns}
    names = list(fns)
    for r in range(6):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(triton.testing.do_bench(fns[n], warmup=30, rep=150, return_mode="median") * 1000)
    for n in names:
        row = dict(case=case, kernel=n, us=round(statistics.median(times[n]), 1), rounds=[round(t, 1) for t in times[n]],
                   bitwise=bool(torch.equal(outs[n], ref)))
        print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
