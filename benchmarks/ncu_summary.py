"""Per-kernel table from `ncu --csv --page raw` files (benchmarks/ncu_profile.sh): time, launch shape,
registers, occupancy, issue rate, pipe use, DRAM throughput, spills and the three largest stall reasons.

    python benchmarks/ncu_summary.py bench_out/ncu/*-raw.csv
"""
from __future__ import annotations

import csv
import sys

STALL = "smsp__average_warps_issue_stalled_"
COLUMNS = [  # (heading, metric, format)
    ("us", "gpu__time_duration.sum", "{:.0f}"),
    ("regs", "launch__registers_per_thread", "{:.0f}"),
    ("smem KB", "launch__shared_mem_per_block", "{:.0f}"),
    ("occ th%", "sm__maximum_warps_per_active_cycle_pct", "{:.0f}"),
    ("occ %", "sm__warps_active.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("fma %", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("xu %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("lsu %", "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("dram %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "{:.0f}"),
    ("spill inst", "sass__inst_executed_register_spilling", "{:.0f}"),
]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def kernels(path):
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    header, units = rows[start], rows[start + 1]
    for row in rows[start + 2:]:
        if len(row) != len(header):
            continue
        rec = dict(zip(header, row))
        rec["_units"] = dict(zip(header, units))
        yield rec


def value(rec, metric):
    v = number(rec.get(metric, ""))
    if v is None:
        return None
    unit = rec["_units"].get(metric, "").split("/")[0]     # "Kbyte/block" -> "Kbyte"
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "byte": 1 / 1024, "Kbyte": 1.0, "Mbyte": 1024.0}.get(unit, 1.0)
    return v * scale


def summarise(path):
    print(f"## {path}")
    print("| kernel | grid x block | " + " | ".join(h for h, _, _ in COLUMNS) + " | top stalls (warps per issue) |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    seen = set()
    for rec in kernels(path):
        if rec["Kernel Name"] + rec["Grid Size"] in seen and "--all" not in sys.argv:
            continue                                   # a time-segmented backward repeats its kernels
        seen.add(rec["Kernel Name"] + rec["Grid Size"])
        cells = []
        for _, metric, fmt in COLUMNS:
            v = value(rec, metric)
            cells.append("" if v is None else fmt.format(v))
        stalls = sorted(((value(rec, k) or 0.0, k[len(STALL):].replace("_per_issue_active.ratio", ""))
                         for k in rec if k.startswith(STALL) and k.endswith("_per_issue_active.ratio")),
                        reverse=True)[:3]
        top = ", ".join(f"{name} {v:.1f}" for v, name in stalls)
        print(f"| {rec['Kernel Name'][:28]} | {rec['Grid Size']} x {rec['Block Size']} | "
              + " | ".join(cells) + f" | {top} |")
    print()


if __name__ == "__main__":
    for p in (a for a in sys.argv[1:] if a != "--all"):
        summarise(p)
