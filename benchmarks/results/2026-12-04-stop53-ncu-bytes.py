"""No-grad forward steps of gated_delta_rule under ncu, the profiler range only around the measured steps (stop 53).

    python benchmarks/results/2026-12-04-stop53-ncu-bytes.py --case 1,131072,16,32 --steps 3 [--module path.py]
"""
import argparse, importlib, sys
import torch
sys.path.insert(0, ".")
from benchmarks.profile_stages import step_fn
from gdngen.spec import load_spec
p = argparse.ArgumentParser()
p.add_argument("--case"); p.add_argument("--steps", type=int, default=3)
p.add_argument("--module", default="generated.gated_delta_rule")
a = p.parse_args()
spec = load_spec("specs/gated_delta_rule.yaml")
if a.module.endswith(".py"):
    import importlib.util
    s = importlib.util.spec_from_file_location("modx", a.module); m = importlib.util.module_from_spec(s); s.loader.exec_module(m)
else:
    m = importlib.import_module(a.module)
case = [int(x) for x in a.case.split(",")]
with torch.no_grad():
    step = step_fn(spec, m, case, backward=False)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
