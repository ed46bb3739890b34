"""Host time of one generated op call: where the Python before and between the launches goes.

    python benchmarks/host_profile.py [--spec gated_delta_rule] [--shape 1,8192,16,32] [--calls 50]

Times ``--calls`` forward calls and forward+backward calls back to back (the host's rate: the GPU
keeps up when each call's kernels take longer than its host time), then the same under cProfile,
and prints the top functions by own time. CUDA only.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.host_split import host_ms, print_profile  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="gated_delta_rule")
    parser.add_argument("--shape", default="1,8192,16,32")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    B, T, H, HV = (int(n) for n in args.shape.split(","))
    module = importlib.import_module(f"generated.{args.spec}")
    fn = getattr(module, f"chunk_{args.spec}")
    K = V = 128
    x = dict(q=torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16),
             k=F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16(),
             v=torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16),
             g=F.logsigmoid(torch.randn(B, T, HV, device="cuda")),
             beta=torch.rand(B, T, HV, device="cuda", dtype=torch.bfloat16),
             initial_state=torch.zeros(B, HV, K, V, device="cuda"))
    x = {n: t.requires_grad_() for n, t in x.items()}

    def forward():
        with torch.no_grad():
            return fn(**x, output_final_state=True)

    def train():
        o, h = fn(**x, output_final_state=True)
        torch.autograd.grad([o, h], list(x.values()), [torch.ones_like(o), torch.ones_like(h)])

    for name, step in (("forward", forward), ("forward+backward", train)):
        host, total = host_ms(step, args.calls)
        print(f"{name}: host {host:.3f} ms per call, host+GPU {total:.3f} ms per call", flush=True)
        print_profile(step, args.calls, "tottime", args.top)


if __name__ == "__main__":
    main()
