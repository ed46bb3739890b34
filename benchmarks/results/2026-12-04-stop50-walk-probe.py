"""Time the pieces' walks (the Triton _state_bwd_kernel / _state_fwd_kernel WINDOW launches) under tile overrides."""
import itertools, json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from collections import defaultdict
from gdngen import bench
from gdngen.spec import load_spec
from gdngen.runtime.backward_tiles import override_backward
import importlib
spec = load_spec("specs/gated_delta_rule.yaml")
module = importlib.import_module("generated.gated_delta_rule")
impl = bench.load_impls(["gdngen"], spec, module, "cuda")["gdngen"]
out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
case = bench.Case("1,32768,32,32", 1, 32768, 32, 32)
inputs = bench.make_inputs(spec, case, torch.bfloat16, "cuda", requires_grad=True)
leaves = [x for x in inputs.values() if x.requires_grad]
do = torch.randn_like(impl(inputs))
def step():
    impl(inputs).backward(do)
    for x in leaves: x.grad = None
ref = None
configs = [None] + [dict(BV=bv, num_warps=nw, num_stages=ns) for bv, nw, ns in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
for cfg in configs:
    ctx = override_backward("state", **cfg) if cfg else None
    try:
        if ctx: ctx.__enter__()
        impl(inputs).backward(do)
        grads = [x.grad.clone() for x in leaves]
        for x in leaves: x.grad = None
        if ref is None: ref = grads
        same = all(torch.equal(a, b) for a, b in zip(grads, ref))
        for _ in range(3): step()
        torch.cuda.synchronize()
        kernels = defaultdict(float)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10): step()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_time_total > 0 and "state" in e.key:
                kernels[e.key[:40]] += e.device_time_total / 10
        row = {"cfg": cfg, "bitwise": same, "us": {k: round(v, 1) for k, v in kernels.items()}}
    except Exception as exc:
        row = {"cfg": cfg, "error": repr(exc)[:200]}
    finally:
        if ctx: ctx.__exit__(None, None, None)
    print(json.dumps(row), flush=True)
    if out: out.write(json.dumps(row) + "\n"); out.flush()
