import os, importlib, importlib.util, sys, time
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, "/work/main")
from gdngen.bf16_emulation import patch_bf16_interpreter
from gdngen.selfcheck import gradient_errors
from gdngen.spec import load_spec
patch_bf16_interpreter()
spec = load_spec("specs/gated_delta_rule.yaml")
def load(path, name):
    ms = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(ms); sys.modules[name]=m; ms.loader.exec_module(m); return m
old = load("/work/main/variant_tmp/gdr_head.py", "gdr_head")
new = importlib.import_module("generated.gated_delta_rule")
shape = dict(B=1, T=256, H=2, HV=4, K=64, V=64)
for seed in (0, 1):
    for label, m in (("head", old), ("new", new)):
        t = time.time()
        e = gradient_errors("gated_delta_rule", {}, spec=spec, module=m, seed=seed, **shape)
        print(seed, label, {k: f"{v:.3e}" for k, v in e.items()}, f"{time.time()-t:.0f}s", flush=True)
