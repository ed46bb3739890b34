"""Eager calls against CUDA-graph replays (gdngen.runtime.graphs) of gated_delta_rule, one process (CUDA only).

    python benchmarks/graphs_probe.py [--cases "8,2048,16,16 4,8192,16,32"] [--out rows.jsonl]

Per case and mode (fwd+bwd, fwd): the replayed results against the eager ones (bitwise), then for graphs off
and on, interleaved over two rounds: ``do_bench``'s median, the host time per call back to back (no sync
between calls) and the captures / replays counted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8,2048,16,16 4,8192,16,32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from benchmarks.fused_probe import inputs, row_writer
    from benchmarks.gluon_state_probe import host_ms
    from gdngen.runtime import graphs
    from generated.gated_delta_rule import chunk_gated_delta_rule
    record = row_writer(args.out)

    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        x = inputs(B, T, H, HV, grad=True)
        leaves = list(x.values())
        do = torch.randn(B, T, HV, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()

        def train():
            for t in leaves:             # (as do_bench's grad_to_none: an accumulated .grad holds the last result)
                t.grad = None
            chunk_gated_delta_rule(**x)[0].backward(do)

        def forward():
            with torch.no_grad():
                chunk_gated_delta_rule(**x, output_final_state=True)

        def results(mode):
            for t in leaves:
                t.grad = None
            if mode == "fwd":
                with torch.no_grad():
                    return [t.clone() for t in chunk_gated_delta_rule(**x, output_final_state=True)]
            o, _ = chunk_gated_delta_rule(**x)
            o.backward(do)
            return [o.detach().clone()] + [t.grad.clone() for t in leaves]

        for mode, step in (("fwd+bwd", train), ("fwd", forward)):
            graphs.set_enabled(False)
            want = results(mode)
            graphs.set_enabled(True)
            got = [results(mode) for _ in range(5)][-1]
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            for rnd in range(2):
                for on in (False, True):
                    graphs.set_enabled(on)
                    before = (graphs.GRAPHS.captures, graphs.GRAPHS.replays)
                    for _ in range(5):
                        step()
                    ms = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=leaves, return_mode="median")
                    host = host_ms(step, calls=50)
                    for t in leaves:
                        t.grad = None
                    record(dict(case=text, mode=mode, graphs=on, round=rnd, ms=round(ms, 4), host_ms=round(host, 4),
                                bitwise_equal_to_eager=same, captures=graphs.GRAPHS.captures - before[0],
                                replays=graphs.GRAPHS.replays - before[1]))
            graphs.GRAPHS.clear()


if __name__ == "__main__":
    main()
