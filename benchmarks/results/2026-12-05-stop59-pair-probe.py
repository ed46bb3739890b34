"""Stop 59's probe (CUDA only): is the (1,131072,16,32) forward pass's spread between windows (1403-1695 us, stop 52,
"not explained") its value-head pairs losing their shared key and query reads?

With H = 16 and HV = 32, value heads 2h and 2h + 1 read the same k and q tiles. Their two programs run side by
side, and L2 serves the second read while the pair stays within a few chunks of each other. L2 holds ~5 chunks
of all 128 programs' traffic. Over 512 chunks a 1% difference in pace puts a pair past that, and then both
programs read k and q from DRAM: ~72 KB a chunk instead of ~56 (+29%).

Per window (a random allocation held first, as stop 52's windows were made), the Gluon pass's kernel time
(torch.profiler, 10 calls) is taken for two inputs, alternating:
- the case as given (`shared`);
- k and q repeated per value head (H = 32, `own`): every program reads its own copies, as a pair that drifted
  apart does. The outputs are the same (checked bitwise once).

Prediction: if pairs drift, `shared` moves between ~1.4 ms and the `own` time from window to window, and its slow
windows read like `own`. If not, `shared` stays near its best in every window and `own` sits 20-30% above it.
Either way, a cluster of two CTAs per pair with the key tiles multicast would be the fix to price next.

    python benchmarks/results/2026-12-05-stop59-pair-probe.py [--case 1,131072,16,32] [--windows 8]
"""
import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.fused_probe import inputs  # noqa: E402
from benchmarks.tuner_timing_check import kernel_times  # noqa: E402
from gdngen.runtime.graphs import set_enabled as set_graphs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="1,131072,16,32")
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    from generated import gated_delta_rule as module
    B, T, H, HV = (int(n) for n in args.case.split(","))
    shared = inputs(B, T, H, HV, grad=False)
    own = dict(shared, q=shared["q"].repeat_interleave(HV // H, dim=2).contiguous(),
               k=shared["k"].repeat_interleave(HV // H, dim=2).contiguous())
    layouts = {"shared": shared, "own": own}

    def forward(x):
        with torch.no_grad():
            return module.chunk_gated_delta_rule(**x, output_final_state=True)

    out = open(os.path.join(os.environ.get("OUT", "."), "pair-probe.jsonl"), "a")

    def record(row):
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    (o_shared, ht_shared), (o_own, ht_own) = forward(shared), forward(own)
    record(dict(case=args.case, check="own vs shared", o_equal=torch.equal(o_shared, o_own),
                state_equal=torch.equal(ht_shared, ht_own)))
    del o_shared, ht_shared, o_own, ht_own
    set_graphs(False)                   # each kernel on its own in the profile
    passes = {name: [] for name in layouts}
    rng = random.Random(59)
    for window in range(args.windows):
        hold = torch.empty(rng.randint(1, 512) << 20, dtype=torch.uint8, device="cuda")
        for name in (list(layouts) if window % 2 == 0 else list(layouts)[::-1]):
            times = kernel_times(lambda: forward(layouts[name]), reps=10)
            pass_us = sum(us for kernel, us in times.items() if "state_output_gluon" in kernel)
            passes[name].append(pass_us)
            record(dict(case=args.case, window=window, layout=name, pass_us=round(pass_us, 1),
                        kernels_us={kernel[:40]: round(us, 1) for kernel, us in times.items()}))
        del hold
    for name, values in passes.items():
        record(dict(case=args.case, layout=name, pass_us_min=round(min(values), 1),
                    pass_us_median=round(statistics.median(values), 1), pass_us_max=round(max(values), 1)))


if __name__ == "__main__":
    main()
