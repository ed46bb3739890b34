"""A shipped (tuned) launch config against the defaults on one realistic shape: the op's outputs with
the table's entries and with the stages forced back to their defaults must agree to rounding.

    python benchmarks/check_tuned_vs_default.py kda 4,8192,16,16 state wy
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys

import torch

from gdngen.bench import Case, make_inputs
from gdngen.runtime import override
from gdngen.runtime.tiles import default_tiles
from gdngen.spec import load_spec


def main():
    name, case, stages = sys.argv[1], sys.argv[2], sys.argv[3:]
    B, T, H, HV = (int(x) for x in case.split(","))
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, Case("check", B, T, H, HV, 128, 128), torch.bfloat16, os.environ.get("DEVICE", "cuda"))
    op = getattr(module, spec.chunk_function)
    tuned = op(**inputs, output_final_state=True)
    per_channel = spec.transition.decay == "vector"
    with contextlib.ExitStack() as stack:
        for stage in stages:
            defaults = default_tiles(stage, K=128, V=128, BT=64, N=B, HV=HV, dtype=torch.bfloat16,
                                     per_channel=per_channel)
            stack.enter_context(override(name, stage, **defaults))
        default = op(**inputs, output_final_state=True)
    for label, a, b in (("o", tuned[0], default[0]), ("final state", tuned[1], default[1])):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        print(f"{name} {case} tuned {stages} vs defaults: {label} rel diff {err:.3e}", flush=True)


if __name__ == "__main__":
    main()
