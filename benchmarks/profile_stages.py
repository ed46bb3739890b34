"""Where a generated chunk op spends its time, and which launch parameters each stage prefers.

Per case: a per-kernel breakdown (torch.profiler, CUDA time per call) of the forward (and with
--backward of a forward+backward step), then with --sweep a sweep that varies one forward stage's
launch parameters at a time (gdngen.runtime.override) and times the whole forward with do_bench
(--sweep-backward: one backward stage's, override_backward, timing forward+backward).
Any catalogue spec (--spec; inputs as `gdngen bench` draws them). Rows go to $OUT/stages.jsonl as
measured, each with its spec.

    python benchmarks/profile_stages.py [--spec gated_delta_rule] [--cases 0,1] [--backward] [--sweep]
    python benchmarks/profile_stages.py --spec gla --cases 4 --backward     # (4,8192,16,16), issue #7
    python benchmarks/profile_stages.py --spec kda --cases 4 --sweep-backward --stages wy_decay
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton

from gdngen.bench import Case, make_inputs
from gdngen.plan import build_plan
from gdngen.runtime import override
from gdngen.runtime.backward_tiles import override_backward
from gdngen.spec import load_spec

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)
CASES = [(4, 8192, 16, 32), (1, 131072, 16, 32), (8, 2048, 16, 16), (1, 32768, 2, 8), (4, 8192, 16, 16),
         (1, 32768, 32, 32)]
K = V = 128
DEVICE = "cuda"
SWEEP = {
    "wy": [dict(BK=bk, num_warps=w, num_stages=s) for bk, w, s in itertools.product([32, 64], [1, 2, 4, 8], [1, 2])],
    "state": [dict(BV=bv, num_warps=w, num_stages=s)
              for bv, w, s in itertools.product([16, 32, 64], [4, 8], [2, 3])],   # 1 stage: illegal address (GDN)
    "output": [dict(BK=bk, BV=bv, num_warps=w, num_stages=s)
               for bk, bv, w, s in itertools.product([64, 128], [64, 128], [4, 8], [2, 3])],
}
# backward stages (gdngen.runtime.backward_tiles.override_backward), timed as a forward+backward step
SWEEP_BACKWARD = {
    "wy_decay": [dict(BK=bk, num_warps=w, num_stages=s) for bk, w, s in itertools.product([32, 64], [4, 8], [1, 2])],
    # never below 64 in the wide stages (the tile rule in backward_tiles.py; BK=32 in wy faulted on the H200)
    "wy": [dict(BK=64, BV=bv, num_warps=w, num_stages=s) for bv, w, s in itertools.product([64, 128], [4, 8], [1, 2])],
    "chunk": [dict(BK=64, BV=bv, num_warps=w, num_stages=s) for bv, w, s in itertools.product([64, 128], [4, 8], [1, 2])],
    "intra": [dict(BK=32, BV=bv, num_warps=w, num_stages=s) for bv, w, s in itertools.product([64, 128], [4, 8], [1, 2])],
    "wy_prep": [dict(BK=bk, num_warps=w, num_stages=s) for bk, w, s in itertools.product([64, 128], [4, 8], [1, 2])],
    "state": [dict(BV=bv, num_warps=w, num_stages=s) for bv, w, s in itertools.product([16, 32, 64], [4, 8], [2, 3])],
}


def log(row):
    with open(os.path.join(OUT, "stages.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def step_fn(spec, module, case, backward):
    """The op on fresh bf16 inputs of ``case``: forward only, or forward + backward."""
    B, T, H, HV = case
    inputs = make_inputs(spec, Case("profile", B, T, H, HV, K, V), torch.bfloat16 if DEVICE == "cuda" else torch.float32, DEVICE,
                         requires_grad=backward)
    chunk = getattr(module, spec.chunk_function)
    if not backward:
        return lambda: chunk(**inputs)
    leaves = [x for x in inputs.values() if x.requires_grad]
    do = torch.randn_like(inputs["v"])

    def step():
        o = chunk(**inputs)[0]
        torch.autograd.backward(o, do)
        for x in leaves:
            x.grad = None
    return step


def breakdown(spec, case, fn, mode):
    fn()
    torch.cuda.synchronize()
    reps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.key_averages():
        us = evt.device_time_total / reps
        if us > 0:
            total += us
            log({"kind": "kernel", "spec": spec.name, "mode": mode, "case": case, "name": evt.key[:60],
                 "us_per_call": us})
    log({"kind": "kernels_total", "spec": spec.name, "mode": mode, "case": case, "us_per_call": total,
         "do_bench_us": 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")})


def sweep(spec, case, fn, stages=None, backward=False):
    plan = build_plan(spec)
    present = {s.name for s in (plan.backward_stages if backward else plan.stages)}
    for stage, variants in (SWEEP_BACKWARD if backward else SWEEP).items():
        if stage not in present or (stages and stage not in stages):
            continue
        for cfg in variants:
            try:
                with (override_backward(stage, **cfg) if backward else override(spec.name, stage, **cfg)):
                    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is data too
                log({"kind": "sweep", "spec": spec.name, "case": case, "backward": backward, "stage": stage, "cfg": cfg,
                     "error": repr(exc)[:120]})
                continue
            log({"kind": "sweep", "spec": spec.name, "case": case, "backward": backward, "stage": stage, "cfg": cfg,
                 "ms": ms})


def main():
    import importlib
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="gated_delta_rule", help="a catalogue spec (specs/<name>.yaml)")
    parser.add_argument("--cases", default="0,1,2,3", help=f"comma-separated indices into {CASES}")
    parser.add_argument("--backward", action="store_true", help="also break down a forward+backward step")
    parser.add_argument("--sweep", action="store_true", help="sweep the forward stages' launch parameters")
    parser.add_argument("--sweep-backward", action="store_true",
                        help="sweep the backward stages' launch parameters (timing forward+backward steps)")
    parser.add_argument("--stages", default="", help=f"comma-separated subset of {list(SWEEP)} (or with "
                        f"--sweep-backward {list(SWEEP_BACKWARD)}) to sweep (default all)")
    a = parser.parse_args()
    spec = load_spec(f"specs/{a.spec}.yaml")
    module = importlib.import_module(f"generated.{spec.name}")
    for i in map(int, a.cases.split(",")):
        case = list(CASES[i])
        with torch.no_grad():
            fwd = step_fn(spec, module, case, backward=False)
            breakdown(spec, case, fwd, "fwd")
            if a.sweep:
                sweep(spec, case, fwd, [x for x in a.stages.split(",") if x])
        if a.backward or a.sweep_backward:
            step = step_fn(spec, module, case, backward=True)
            breakdown(spec, case, step, "fwd+bwd")
            if a.sweep_backward:
                sweep(spec, case, step, [x for x in a.stages.split(",") if x], backward=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
