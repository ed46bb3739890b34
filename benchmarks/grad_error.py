"""Every output and gradient of one op against the float64 reference, for gdngen and FLA side by side.

Relative RMSE (as the GPU tests measure it) of o and of the gradient of every floating input, for bf16
(or --dtype) inputs drawn by gdngen.bench.make_inputs, one random output gradient, and autograd through
gdngen.reference (chunked form) in float64. FLA's op of the same name (gdngen.bench.FLA_PEERS) gets the
same leaves. Written to answer one question the GPU tests cannot: whether a gap to the issue's bar
(bf16 dq/dk/dv 8e-3) is ours or the formulation's (stop 22: linear_attn's normalize=True dq).
Rows go to $OUT/grad_error.jsonl.

    python benchmarks/grad_error.py --op linear_attn --case 2,2048,8,8 --options '{"normalize": true}' \
        --impls gdngen,fla
"""
import argparse
import importlib
import json
import os

import torch

from gdngen import reference
from gdngen.bench import Case, fla_peer, make_inputs
from gdngen.selfcheck import rel_rmse
from gdngen.spec import load_spec

OUT = os.environ.get("OUT", "bench_out")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="linear_attn", help="a catalogue spec (specs/<op>.yaml)")
    parser.add_argument("--case", default="2,2048,8,8", help="B,T,H,HV (FLA's non-GVA ops need H == HV)")
    parser.add_argument("--dims", default="128,128", help="K,V")
    parser.add_argument("--options", default="{}", help="JSON keyword options for both ops and the reference")
    parser.add_argument("--impls", default="gdngen,fla")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--positive-qk", action="store_true",
                        help="q, k = elu(randn) + 1, as the GPU tests draw them for normalize=True (signed q, k "
                             "put q . sum k through zero and every implementation's error without bound)")
    a = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    B, T, H, HV = map(int, a.case.split(","))
    K, V = map(int, a.dims.split(","))
    options = json.loads(a.options)
    spec = load_spec(f"specs/{a.op}.yaml")
    module = importlib.import_module(f"generated.{a.op}")
    inputs = make_inputs(spec, Case("grad_error", B, T, H, HV, K, V), DTYPES[a.dtype], a.device, seed=a.seed)
    if a.positive_qk:
        for n in ("q", "k"):
            inputs[n] = (torch.nn.functional.elu(inputs[n].float()) + 1).to(inputs[n].dtype)
    gen = torch.Generator(device=a.device).manual_seed(a.seed + 1)
    do = torch.randn(B, T, HV, V, device=a.device, generator=gen)

    ref = {n: x.detach().double().requires_grad_(True) for n, x in inputs.items()}
    positional = [ref.get(n) for n in ("q", "k", "v", "g", "beta")]
    ro, _ = reference.run(spec, *positional, form="chunked", **options)
    want = torch.autograd.grad(ro, [ref[n] for n in ref], do.double())

    chunk = getattr(module, spec.chunk_function)
    impls = {}
    if "gdngen" in a.impls.split(","):
        impls["gdngen"] = lambda x: chunk(**x, **options)[0]
    if "fla" in a.impls.split(","):
        peer = fla_peer(a.op)
        if peer is not None:
            # FLA_PEERS pins FLA's defaults (e.g. normalize=True); options here must agree with them.
            # FLA's op takes no feature map: elu+1 is applied to its q, k by autograd, outside the op.
            if options.get("feature_map") in ("elu", "elu+1"):
                mapped = peer
                peer = lambda x, mapped=mapped: mapped({**x, **{n: torch.nn.functional.elu(x[n]) + 1 for n in ("q", "k")}})
            impls["fla"] = peer
    for name, fn in impls.items():
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()}
        try:
            o = fn(leaves)
            got = torch.autograd.grad(o, list(leaves.values()), do.to(o.dtype))
        except Exception as exc:  # noqa: BLE001 - a peer that refuses is a row too
            row = {"op": a.op, "impl": name, "case": [B, T, H, HV, K, V], "options": options, "error": repr(exc)[:300]}
        else:
            row = {"op": a.op, "impl": name, "case": [B, T, H, HV, K, V], "dtype": a.dtype, "options": options,
                   "rel_rmse": {"o": rel_rmse(o, ro), **{f"d{n}": rel_rmse(g, w) for n, g, w in zip(leaves, got, want)}}}
        with open(os.path.join(OUT, "grad_error.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
