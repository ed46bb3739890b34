"""do_bench of the no-grad forward eager against graph-replayed (MAX_WORK lifted), alternating rounds."""
import json, os, statistics, sys, torch, triton
sys.path.insert(0, os.getcwd())
from benchmarks.fused_probe import inputs
import gdngen.runtime.graphs as graphs
import generated.gated_delta_rule as m
out = open(os.path.join(os.environ.get("OUT", "."), "graph_probe.jsonl"), "a")
for case in sys.argv[1:]:
    B, T, H, HV = map(int, case.split(","))
    x = inputs(B, T, H, HV)
    def fn():
        with torch.no_grad():
            return m.chunk_gated_delta_rule(**x, output_final_state=True)
    res = {"eager": [], "graph": []}
    walls = {"eager": [], "graph": []}
    for r in range(4):
        for mode in (["eager", "graph"] if r % 2 == 0 else ["graph", "eager"]):
            graphs.set_enabled(mode == "graph")
            graphs.MAX_WORK = (1 << 40) if mode == "graph" else (1 << 33)
            graphs.GRAPHS.clear()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            res[mode].append(triton.testing.do_bench(fn, warmup=30, rep=300, return_mode="median"))
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(); s.record()
            for _ in range(20):
                fn()
            e.record(); torch.cuda.synchronize()
            walls[mode].append(s.elapsed_time(e) / 20)
    for mode in res:
        row = dict(case=case, mode=mode, do_bench_ms=[round(v, 4) for v in res[mode]], median=round(statistics.median(res[mode]), 4),
                   wall_ms=[round(v, 4) for v in walls[mode]])
        print(json.dumps(row)); out.write(json.dumps(row) + "\n"); out.flush()
