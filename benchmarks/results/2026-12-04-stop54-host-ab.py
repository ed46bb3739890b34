"""Host time against wall time per fwd+bwd step, two renderings (stop 54)."""
import json, os, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch, triton
from benchmarks.fused_probe import inputs, load_module
paths = sys.argv[1].split()
cases = sys.argv[2].split()
out = open(os.path.join(os.environ.get("OUT", "."), "host_ab.jsonl"), "a")
mods = [load_module(ROOT / p, f"m{i}") for i, p in enumerate(paths)]
for text in cases:
    B, T, H, HV = map(int, text.split(","))
    x = inputs(B, T, H, HV, grad=True)
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
    do = torch.randn(B, T, HV, 128, device="cuda").bfloat16()
    def step(m):
        o, _ = m.chunk_gated_delta_rule(**x)
        return torch.autograd.grad(o, leaves, do)
    for rnd in range(3):
        for p, m in (zip(paths, mods) if rnd % 2 == 0 else list(zip(paths, mods))[::-1]):
            for _ in range(3):
                step(m)
            torch.cuda.synchronize()
            k = m._chunk_bwd_gluon_fast
            miss, fb = k.misses, k.fallbacks
            n = 20
            t0 = time.perf_counter()
            for _ in range(n):
                step(m)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            ms = triton.testing.do_bench(lambda: step(m), warmup=10, rep=200, return_mode="median")
            row = dict(case=text, module=p, round=rnd, host_ms=round((t1 - t0) / n * 1e3, 3), wall_ms=round((t2 - t0) / n * 1e3, 3),
                       do_bench_ms=round(ms, 3), chunk_misses=k.misses - miss, chunk_fallbacks=k.fallbacks - fb)
            print(row, flush=True)
            out.write(json.dumps(row) + "\n"); out.flush()
