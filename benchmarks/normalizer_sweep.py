"""Launch parameters of linear attention's normalizer stage on the GPU (issue #7).

For each (BT, max BK, warps, loop stages), the module constants the launcher reads are set and
chunk_linear_attn(normalize=True) is timed forward and forward+backward (do_bench median) at one
case; the defaults' row comes first. The normaliser's share is the difference to normalize=False,
timed once. Rows go to $OUT/normalizer.jsonl as they are measured.

    python benchmarks/normalizer_sweep.py [--case 1,32768,32,32]
"""
import argparse
import itertools
import json
import os

import torch
import triton

import generated.linear_attn as module
from gdngen.bench import Case, make_inputs
from gdngen.spec import load_spec

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
NAMES = ("_NORMALIZER_BT", "_NORMALIZER_MAX_BK", "_NORMALIZER_WARPS", "_NORMALIZER_STAGES")


def log(row):
    with open(os.path.join(OUT, "normalizer.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="1,32768,32,32")
    a = parser.parse_args()
    B, T, H, HV = map(int, a.case.split(","))
    spec = load_spec("specs/linear_attn.yaml")
    inputs = make_inputs(spec, Case("normalizer", B, T, H, HV, 128, 128), torch.bfloat16, "cuda", requires_grad=True)
    leaves = [x for x in inputs.values() if x.requires_grad]
    do = torch.randn_like(inputs["v"])

    def fwd(normalize):
        return lambda: module.chunk_linear_attn(**inputs, normalize=normalize)

    def step(normalize):
        def run():
            o = module.chunk_linear_attn(**inputs, normalize=normalize)[0]
            torch.autograd.backward(o, do)
        return run

    def time(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, grad_to_none=leaves, return_mode="median")

    log({"case": [B, T, H, HV], "normalize": False, "fwd_ms": time(fwd(False)), "fwd_bwd_ms": time(step(False))})
    defaults = tuple(getattr(module, n) for n in NAMES)
    configs = [defaults] + [c for c in itertools.product([64, 128, 256], [32, 64], [4, 8], [2, 3]) if c != defaults]
    for cfg in configs:
        for n, value in zip(NAMES, cfg):
            setattr(module, n, value)
        try:
            row = {"case": [B, T, H, HV], "cfg": dict(zip(NAMES, cfg)), "fwd_ms": time(fwd(True)),
                   "fwd_bwd_ms": time(step(True))}
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is data too
            row = {"case": [B, T, H, HV], "cfg": dict(zip(NAMES, cfg)), "error": repr(exc)[:160]}
        log(row)
    for n, value in zip(NAMES, defaults):
        setattr(module, n, value)


if __name__ == "__main__":
    main()
