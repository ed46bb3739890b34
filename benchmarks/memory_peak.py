"""Which tensors are alive at the peak of one GDN chunk forward+backward step (CUDA).

Replays torch.cuda.memory's allocation history of one step (after a warm-up step) and writes the
live blocks at the peak, largest first, each with the innermost gdngen/generated source line that
allocated it, to $OUT/memory_peak.txt.

    python benchmarks/memory_peak.py [B T H HV]
"""
import os
import sys

import torch

from bench_backward import inputs
from generated.gated_delta_rule import chunk_gated_delta_rule

OUT = os.environ.get("OUT", "bench_out")
os.makedirs(OUT, exist_ok=True)


def main():
    B, T, H, HV = map(int, sys.argv[1:5]) if len(sys.argv) > 4 else (1, 32768, 32, 32)
    leaves, do = inputs(B, T, H, HV)

    def step():
        o, _ = chunk_gated_delta_rule(*leaves)
        o.backward(do)
        for x in leaves:
            x.grad = None

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_stat = (torch.cuda.max_memory_allocated() - base) / 2**20
    live, total, best, best_live = {}, 0, -1, {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > best:
            best, best_live = total, dict(live)
    lines = [f"case {(B, T, H, HV)}: peak over base {peak_stat:.0f} MiB; replayed peak {best / 2**20:.0f} MiB "
             f"of step allocations, {len(best_live)} blocks live there"]
    for e in sorted(best_live.values(), key=lambda e: -e["size"])[:20]:
        frame = next((f for f in e.get("frames", []) if "generated/" in f["filename"] or "gdngen/" in f["filename"]
                      or "bench" in f["filename"]), None)
        where = f"{os.path.basename(frame['filename'])}:{frame['line']} {frame['name']}" if frame else "?"
        lines.append(f"{e['size'] / 2**20:9.1f} MiB  {where}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, "memory_peak.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
