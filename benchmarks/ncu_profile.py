"""One forward(+backward) step of a generated op under Nsight Compute, for stall reasons and occupancy.

The step is warmed up (compiled, autotune cache read) outside the profiled range; only the step
after `cudaProfilerStart` is captured, so run it under `ncu --profile-from-start off`. Triton kernel
names start with an underscore, so `--kernel-name regex:^_` keeps PyTorch's own kernels out.

    ncu --profile-from-start off --clock-control none --kernel-name regex:^_ \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --csv --page details --log-file $OUT/gla.csv \
        python3 benchmarks/ncu_profile.py --spec gla --case 4,8192,16,16 --backward

`ncu_summary.py` turns the CSV into a per-kernel table.
"""
from __future__ import annotations

import argparse
import importlib

import torch

from benchmarks.profile_stages import step_fn
from gdngen.spec import load_spec


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--case", default="4,8192,16,16", help="B,T,H,HV (K = V = 128, bf16)")
    parser.add_argument("--backward", action="store_true", help="profile a forward+backward step")
    a = parser.parse_args()
    spec = load_spec(f"specs/{a.spec}.yaml")
    module = importlib.import_module(f"generated.{spec.name}")
    case = [int(x) for x in a.case.split(",")]
    print(f"ncu_profile: spec={spec.name} case={case} backward={a.backward}", flush=True)
    with torch.set_grad_enabled(a.backward):
        step = step_fn(spec, module, case, backward=a.backward)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
