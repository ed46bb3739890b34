"""Interleaved A/B of the forward wy kernel alone: modules given on argv, rounds alternate."""
import importlib.util, sys, json, os, statistics, torch, triton
from gdngen.runtime.tma import key_tile_config
from gdngen.runtime.tiles import default_tiles
def load(p, name):
    spec = importlib.util.spec_from_file_location(name, p); m = importlib.util.module_from_spec(spec); sys.modules[name]=m; spec.loader.exec_module(m); return m
mods = [load(p, f"m{i}") for i, p in enumerate(sys.argv[1:])]
out = open(os.path.join(os.environ.get("OUT", "."), "wy_bench.jsonl"), "a")
for case in ["1,131072,16,32", "1,32768,32,32", "4,8192,16,32", "8,2048,16,16"]:
    B, T, H, HV = map(int, case.split(",")); K = V = 128; BT = 64; NT = T // BT
    torch.manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    beta = torch.rand(B, T, HV, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3).view(B, NT, BT, HV).cumsum(2).view(B, T, HV)
    cfg, k_desc = key_tile_config(default_tiles("wy", K=K, V=V, BT=BT, N=B, HV=HV, dtype=torch.bfloat16), k, H=H, K=K, BT=BT)
    outs, fns = [], []
    for m in mods:
        tmat = torch.full((B, T, HV, BT), float("nan"), device="cuda", dtype=torch.bfloat16)
        extra = ()
        if "tmat_desc" in m._wy_fwd_kernel_bt64.arg_names:
            from triton.tools.tensor_descriptor import TensorDescriptor
            extra = (TensorDescriptor(tmat, [B * T, HV * BT], [HV * BT, 1], [BT, BT]),)
        def fn(m=m, tmat=tmat, extra=extra):
            m._WY_FAST[64][(NT, B * HV)](None, k, k_desc, *extra, None, beta, g, tmat, None, None, None, None, None, T,
                H=H, HV=HV, K=K, V=V, BT=BT, BV=64, STORE_WU=False, STORE_AQK=False, IS_VARLEN=False,
                DOT_PRECISION="tf32", SOLVE_PRECISION="tf32", **cfg)
        fn(); torch.cuda.synchronize(); outs.append(tmat); fns.append(fn)
    for i in range(1, len(mods)):
        print(case, sys.argv[1 + i], "max diff vs first", (outs[i].float() - outs[0].float()).abs().max().item(), "nan", torch.isnan(outs[i]).sum().item())
    times = [[] for _ in mods]
    for r in range(6):
        for i, fn in enumerate(fns if r % 2 == 0 else fns[::-1]):
            j = i if r % 2 == 0 else len(fns) - 1 - i
            times[j].append(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1000)
    for i, p in enumerate(sys.argv[1:]):
        row = dict(case=case, module=p, us=statistics.median(times[i]), rounds=[round(t, 1) for t in times[i]])
        print(json.dumps(row)); out.write(json.dumps(row) + "\n"); out.flush()
