"""First-call time of the generated GDN forward, as a user meets it (issue #5's target: <= 10 s).

Each measurement runs in a fresh Python process with an empty Triton kernel cache (a fresh
machine), so the time includes importing the module, resolving every launch config, and compiling
the kernels. Three tile-table settings:

  shipped   the repo's gdngen/autotune/shipped/<family>.json, no user cache
  empty     no user cache and no shipped table (the built-in defaults)
  warm      shipped table and the Triton cache the `shipped` run left behind (a second session)

GDNGEN_COMPILE_AHEAD=0 in the environment measures the serial compile (each kernel at its launch)
instead of the parallel compile of a first call (gdngen.runtime.precompile).

One JSON row per measurement goes to $OUT/first_call.jsonl as soon as it is measured.

    python benchmarks/first_call.py [--shape 1,8192,16,32] [--modes shipped,empty,warm] [--backward]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch
import torch.nn.functional as F
import gdngen.autotune.cache as cache
from pathlib import Path
if {no_shipped}:
    cache.shipped_path = lambda device: Path("/nonexistent/shipped.json")
from generated.gated_delta_rule import chunk_gated_delta_rule
imported = time.perf_counter() - start
B, T, H, HV = {shape}
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, T, H, 128, device="cuda", generator=gen).bfloat16().requires_grad_({backward})
k = F.normalize(torch.randn(B, T, H, 128, device="cuda", generator=gen), dim=-1).bfloat16().requires_grad_({backward})
v = torch.randn(B, T, HV, 128, device="cuda", generator=gen).bfloat16().requires_grad_({backward})
g = F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 2.0)
beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=gen))
torch.cuda.synchronize()
import cProfile, io, pstats
profiler = cProfile.Profile() if {profile} else None
t0 = time.perf_counter()
if profiler:
    profiler.enable()
o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
torch.cuda.synchronize()
forward = time.perf_counter() - t0
profile_text = None
if profiler:
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    profile_text = text.getvalue()[-12000:]
backward = None
if {backward}:
    t0 = time.perf_counter()
    o.float().square().sum().backward()
    torch.cuda.synchronize()
    backward = time.perf_counter() - t0
from gdngen.autotune.cache import lookup
tuned = {{s: lookup("gated_delta_rule", s, K=128, V=128, BT=64, N=B, HV=HV, dtype=torch.bfloat16, H=H, T=T)
         for s in ("wy", "state", "output")}}
print("ROW" + json.dumps({{"import_s": imported, "first_forward_s": forward, "first_backward_s": backward,
                          "total_s": time.perf_counter() - start, "tuned_configs": tuned, "profile": profile_text}}))
"""


def measure(mode: str, shape: tuple, backward: bool, triton_cache: str, user_cache: str, profile: bool = False) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=triton_cache, GDNGEN_CACHE_DIR=user_cache)
    code = CHILD.format(no_shipped=mode == "empty", shape=tuple(shape), backward=backward, profile=profile)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    rows = [line[3:] for line in done.stdout.splitlines() if line.startswith("ROW")]
    if done.returncode or not rows:
        return {"mode": mode, "shape": list(shape), "error": done.stderr[-2000:]}
    return {"mode": mode, "shape": list(shape), "compile_ahead": os.environ.get("GDNGEN_COMPILE_AHEAD", "1") != "0",
            "process_wall_s": wall, **json.loads(rows[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,8192,16,32", help="B,T,H,HV (K = V = 128, bf16)")
    parser.add_argument("--modes", default="shipped,empty,warm")
    parser.add_argument("--backward", action="store_true", help="also time the first backward")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the first forward; the top entries go to $OUT/first_call_profile_<mode>.txt")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    out = os.environ.get("OUT", "bench_out")
    os.makedirs(out, exist_ok=True)
    user_cache = tempfile.mkdtemp(prefix="gdngen-empty-user-cache-")
    warm_triton = None
    for mode in args.modes.split(","):
        if mode not in ("shipped", "empty", "warm"):
            raise ValueError(f"--modes: unknown mode {mode!r} (shipped, empty, warm)")
        if mode == "warm":
            if warm_triton is None:
                warm_triton = tempfile.mkdtemp(prefix="triton-cache-")
                measure("shipped", shape, args.backward, warm_triton, user_cache)
            triton_cache = warm_triton
        else:
            triton_cache = tempfile.mkdtemp(prefix="triton-cache-")
            if mode == "shipped":
                warm_triton = triton_cache
        row = measure(mode, shape, args.backward, triton_cache, user_cache, args.profile)
        text = row.pop("profile", None)
        if text:
            with open(os.path.join(out, f"first_call_profile_{mode}.txt"), "w") as f:
                f.write(text)
        with open(os.path.join(out, "first_call.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
