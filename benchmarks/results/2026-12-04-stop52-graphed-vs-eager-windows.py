"""Stop 52: the no-grad forward graphed (MAX_WORK_NO_GRAD) against eager, beside FlashQLA, over windows."""
import json, os, statistics, sys, time, torch, triton
sys.path.insert(0, os.getcwd())
from gdngen.bench import load_impls
from gdngen.spec import load_spec
import generated.gated_delta_rule as module
import gdngen.runtime.graphs as graphs
OUT = os.environ.get("OUT", ".")
out = open(os.path.join(OUT, "ab_windows.jsonl"), "a")
def emit(row):
    print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
spec = load_spec("specs/gated_delta_rule.yaml")
impls = load_impls(["gdngen", "flashqla"], spec, module, "cuda")
windows = int(sys.argv[1])
for case in sys.argv[2:]:
    B, T, H, HV = map(int, case.split(","))
    from benchmarks.fused_probe import inputs as probe_inputs
    x = probe_inputs(B, T, H, HV)
    x = {k: v for k, v in x.items() if k in ("q", "k", "v", "g", "beta")}
    def gd():
        with torch.no_grad():
            impls["gdngen"](x)
    def fq():
        with torch.no_grad():
            impls["flashqla"](x)
    for f in (gd, fq):
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    res = {"graphed": [], "eager": [], "flashqla": []}
    order = list(res)
    for w in range(windows):
        for name in (order if w % 2 == 0 else order[::-1]):
            graphs.set_enabled(name != "eager")
            fn = fq if name == "flashqla" else gd
            res[name].append(round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), 4))
        graphs.set_enabled(True)
    row = dict(case=case, **{f"{n}_median": round(statistics.median(v), 4) for n, v in res.items()}, **res,
               replays=graphs.GRAPHS.replays, captures=graphs.GRAPHS.captures)
    row["flashqla_over_graphed"] = round(row["flashqla_median"] / row["graphed_median"], 3)
    row["flashqla_over_eager"] = round(row["flashqla_median"] / row["eager_median"], 3)
    emit(row)
