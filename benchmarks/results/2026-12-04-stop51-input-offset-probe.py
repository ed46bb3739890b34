"""Per-call time of gdngen's no-grad forward with q, k, v placed at different byte offsets (same values)."""
import json, os, sys, torch
from gdngen.bench import make_inputs, Case
from gdngen.spec import load_spec
import generated.gated_delta_rule as m
spec = load_spec("specs/gated_delta_rule.yaml")
out = open(os.path.join(os.environ.get("OUT", "."), "addr.jsonl"), "a")
cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
def placed(t, offset_elems):
    buf = torch.empty(t.numel() + offset_elems + 4096, dtype=t.dtype, device=t.device)
    view = buf[offset_elems:offset_elems + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf
def per_call(fn, n=100):
    ss = [torch.cuda.Event(enable_timing=True) for _ in range(n)]; es = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        cache.zero_(); ss[i].record(); fn(); es[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(ss, es))[n // 2]
for text in sys.argv[1:]:
    B, T, H, HV = map(int, text.split(","))
    x0 = make_inputs(spec, Case(name=text, B=B, T=T, H=H, HV=HV), torch.bfloat16, "cuda")
    ref = None
    layouts = {"none": (0, 0, 0), "all+1KB": (512, 512, 512), "all+64KB": (32768, 32768, 32768),
               "k+1KB": (0, 512, 0), "v+1KB": (0, 0, 512), "q+8KB,v+24KB": (4096, 0, 12288), "k+40KB,v+72KB": (0, 20480, 36864)}
    for rnd in range(2):
        for name, (oq, ok, ov) in layouts.items():
            x = dict(x0); keep = []
            for n_, off in (("q", oq), ("k", ok), ("v", ov)):
                x[n_], b = placed(x0[n_], off); keep.append(b)
            fn = lambda: m.chunk_gated_delta_rule(**x, output_final_state=True)
            with torch.no_grad():
                o, _ = fn()
                if ref is None:
                    ref = o.clone()
                same = torch.equal(o, ref)
                for _ in range(5):
                    fn()
                ms = per_call(fn)
            row = dict(case=text, layout=name, round=rnd, ms=round(ms, 4), same_output=same)
            print(json.dumps(row)); out.write(json.dumps(row) + "\n"); out.flush()
            del x, keep, o
