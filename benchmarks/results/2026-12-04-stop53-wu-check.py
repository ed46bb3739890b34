"""The no-grad forward with the chain's V_new = U - W S (working tree) against main's (X T) and the Triton
pass, each against float64: rel_rmse of o and the final state, NaN-poisoned buffers."""
import json, os, sys
import torch
sys.path.insert(0, ".")
from benchmarks.fused_probe import load_module
from gdngen.runtime import override
from gdngen.selfcheck import call, make_inputs, poisoned_memory, reference_outputs, rel_rmse
from gdngen.spec import load_spec
from pathlib import Path
NAME = "gated_delta_rule"
spec = load_spec(f"specs/{NAME}.yaml")
new = load_module(Path("generated/gated_delta_rule.py"), "gdr_new")
head = load_module(Path("variant_tmp/gdr_head.py"), "gdr_head")
out = open(os.path.join(os.environ.get("OUT", "."), "wu_check.jsonl"), "a")
cases = [(torch.bfloat16, dict(B=1, T=8192, H=2, HV=4), True, 4), (torch.float16, dict(B=1, T=8192, H=2, HV=4), True, 4),
         (torch.bfloat16, dict(B=3, T=2048, H=4, HV=8), True, 1), (torch.float16, dict(B=3, T=2048, H=4, HV=8), True, 1),
         (torch.bfloat16, dict(B=2, T=4096, H=8, HV=8), False, 2), (torch.bfloat16, dict(B=1, T=4096, H=16, HV=32), False, None),
         (torch.bfloat16, dict(B=1, T=4096, H=16, HV=32), True, None)]
with torch.no_grad():
    for dtype, shape, h0, pieces in cases:
        inputs = make_inputs(spec, dtype=dtype, device="cuda", seed=31, K=128, V=128, h0=h0, **shape)
        o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
        res = {}
        for label, mod, gluon in (("new", new, True), ("head", head, True), ("triton", new, False)):
            ctx = [override(NAME, "gluon_state", value=gluon)] + ([override(NAME, "state_pieces", value=pieces)] if pieces else [])
            import contextlib
            with contextlib.ExitStack() as st:
                for c in ctx: st.enter_context(c)
                st.enter_context(poisoned_memory())
                o, ht = call(mod, spec, inputs, output_final_state=True)
            res[label] = (o, ht)
        row = dict(dtype=str(dtype), shape=shape, h0=h0, pieces=pieces)
        for label, (o, ht) in res.items():
            row[label] = dict(o=rel_rmse(o, o_ref), ht=rel_rmse(ht, ht_ref), nan=bool(o.isnan().any() or ht.isnan().any()))
        row["new_vs_head_o"] = rel_rmse(res["new"][0], res["head"][0])
        row["head_equals_triton"] = bool(torch.equal(res["head"][0], res["triton"][0]))
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n"); out.flush()
