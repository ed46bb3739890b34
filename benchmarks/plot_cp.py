"""Tokens/s against GPUs from ``bench_cp.py --mode cp`` rows: one panel per (sequence length, pass),
one line per layout (contiguous shards, striped pieces) from the 1-GPU point, and linear scaling.

    python benchmarks/plot_cp.py OUT.png ROWS.jsonl [ROWS.jsonl ...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gdngen.plot import _PALETTE, Panel, Series, write_line_panels  # noqa: E402


def panels(rows: list) -> list:
    result = []
    for T in sorted({r["T"] for r in rows}):
        for pass_ in ("fwd", "fwd+bwd"):
            mine = [r for r in rows if r["T"] == T and r["pass_"] == pass_ and "ms" in r]
            one = [r for r in mine if r["gpus"] == 1 and r["impl"] == "1 GPU"]
            if not one:
                continue
            base = one[0]["tokens_per_s"] / 1e6
            most = max(r["gpus"] for r in mine)
            series = [Series("linear", [(1, base), (most, base * most)], _PALETTE[7], dashed=True)]
            layouts = [r for r in mine if r["gpus"] > 1]
            for i, r in enumerate(layouts):
                label = r["impl"].split(" ", 2)[-1]
                series.append(Series(f"{label} {r['speedup']:.2f}x", [(1, base), (r["gpus"], r["tokens_per_s"] / 1e6)],
                                     _PALETTE[i % 7]))
            result.append(Panel(f"{pass_} T={T} Mtok/s", series, xlabel="GPUs", xticks=list(range(1, most + 1))))
    return result


def main():
    out, paths = Path(sys.argv[1]), sys.argv[2:]
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print(write_line_panels(panels(rows), out, columns=2, title="GDN context parallel, H=16 HV=32 bf16"))


if __name__ == "__main__":
    main()
