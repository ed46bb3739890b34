"""Where one kernel's warps wait, from Nsight Compute's per-instruction stall sampling (stop 53).

Input: the SASS source page of a report taken with the SourceCounters section,

    ncu ... --section SourceCounters --export pass ...
    ncu --import pass.ncu-rep --page source --csv --print-source sass > source.csv
    python benchmarks/ncu_source_summary.py source.csv [--top 20]

(`benchmarks/results/2026-12-04-stop53-ncu-source.sh` is the run this was written for.) A report of several
kernels, or of one kernel launched more than once, is summarised launch by launch.

A warp-specialised Gluon kernel runs its partitions as separate stretches of code, each opened by a
`USETMAXREG` (the partition's register budget); the summary splits the samples at those instructions, so each
partition gets its own line: samples, warp-instructions executed, and its largest stall reasons. mbarrier waits
that miss compile to an out-of-line loop (`SYNCS.PHASECHK...TRYWAIT` and a branch back to itself) after the
kernel's end; each loop is listed with the partition its exit branch returns to, how often it spun and how
often it was left. A wait that succeeds at its first try never enters the loop: its time shows as `long_sb`
samples on the branch after the inline try-wait. The few-sample segments between partitions are the register
hand-overs.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.ncu_summary import number  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    address: int
    text: str
    executed: int
    samples: int
    stalls: Counter


@dataclass
class Segment:
    """A stretch of code from one USETMAXREG to the next (a partition, or the kernel's prologue)."""
    first: int
    label: str
    instructions: list = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    @property
    def executed(self) -> int:
        return sum(i.executed for i in self.instructions)

    def stalls(self) -> Counter:
        total = Counter()
        for ins in self.instructions:
            total.update(ins.stalls)
        return total


def _int(text: str) -> int:
    """A count of the page ("1,234"; "" or "-" where there is none: 0)."""
    return int(number(text) or 0)


def segment_of(parts: list, address: int) -> str:
    """The label of the segment ``address`` lies in."""
    return next((s.label for s in reversed(parts) if s.first <= address), "?")


def read_source_pages(path: str) -> list:
    """[(kernel name, its instructions in address order)] of a `--page source --csv --print-source sass`
    export, one entry per profiled launch (a report of several kernels, or of one kernel launched twice, prints
    one page after another, each opened by a "Kernel Name" row)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    opens = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] or [0]
    pages = []
    for first, end in zip(opens, opens[1:] + [len(rows)]):
        name = rows[first][1] if rows[first] and rows[first][0] == "Kernel Name" and len(rows[first]) > 1 else "?"
        pages.append((name, _instructions(path, rows[first:end])))
    return pages


def read_source_page(path: str) -> list:
    """The first launch's instructions of a source page export, in address order."""
    return read_source_pages(path)[0][1]


def _instructions(path: str, rows: list) -> list:
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise ValueError(f"{path}: no 'Address' header row; export it with --page source --csv --print-source sass")
    header = rows[start]
    column = {name: i for i, name in enumerate(header)}
    for name in (SAMPLES, EXECUTED, "Source"):
        if name not in column:
            raise ValueError(f"{path}: column {name!r} missing; profile with --section SourceCounters")
    stall_columns = [(name[len("stall_"):], i) for name, i in column.items()
                     if name.startswith("stall_") and "Not Issued" not in name]
    instructions = []
    for row in rows[start + 1:]:
        if len(row) < len(header) or not row[0].startswith("0x"):
            continue
        stalls = Counter({reason: _int(row[i]) for reason, i in stall_columns if _int(row[i])})
        instructions.append(Instruction(int(row[0], 16), row[column["Source"]].strip(), _int(row[column[EXECUTED]]),
                                        _int(row[column[SAMPLES]]), stalls))
    instructions.sort(key=lambda ins: ins.address)
    return instructions


def segments(instructions: list) -> list:
    """Split at each USETMAXREG; a segment is labelled by the register count that instruction sets."""
    out = [Segment(instructions[0].address if instructions else 0, "prologue")]
    for ins in instructions:
        match = re.search(r"USETMAXREG\.(\w+)\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", ins.text)
        if match:
            out.append(Segment(ins.address, f"{match.group(1).lower()} {int(match.group(2), 16)} regs"))
        out[-1].instructions.append(ins)
    return [s for s in out if s.instructions]


def wait_loops(instructions: list, parts: list) -> list:
    """Out-of-line mbarrier retry loops: (loop address, returns into segment, spins, exits)."""
    by_address = {ins.address: k for k, ins in enumerate(instructions)}
    loops = []
    for k, ins in enumerate(instructions):
        if "TRYWAIT" not in ins.text or k + 2 >= len(instructions):
            continue
        back = re.search(r"BRA\s+\+?(0x[0-9a-f]+)", instructions[k + 1].text)
        out = re.search(r"BRA\s+\+?(0x[0-9a-f]+)", instructions[k + 2].text)
        if not back or not out or "@" in instructions[k + 2].text:
            continue
        head = int(back.group(1), 16)
        if head not in by_address or head > ins.address:
            continue                         # not a loop back onto itself
        target = int(out.group(1), 16)
        loops.append((head, target, segment_of(parts, target), ins.executed, instructions[k + 2].executed))
    return loops


def summary(path: str, top: int = 20) -> str:
    """The report as text, a section per launch; addresses are offsets from the kernel's first instruction."""
    pages = read_source_pages(path)
    return "\n".join(launch_summary(f"{path} [{name}, launch {k + 1} of {len(pages)}]" if len(pages) > 1 else path,
                                     instructions, top) for k, (name, instructions) in enumerate(pages))


def launch_summary(title: str, instructions: list, top: int) -> str:
    base = instructions[0].address if instructions else 0
    for ins in instructions:
        ins.address -= base
        ins.text = re.sub(r"BRA\s+0x([0-9a-f]+)", lambda m: f"BRA +{int(m.group(1), 16) - base:#x}", ins.text)
    parts = segments(instructions)
    total = sum(s.samples for s in parts) or 1
    lines = [f"{title}: {len(instructions)} instructions, {total} samples"]
    lines.append("segment (opened by, at)   samples  share  warp-instr  largest stall reasons")
    for s in parts:
        stalls = s.stalls()
        n = sum(stalls.values()) or 1
        reasons = ", ".join(f"{r} {100 * v / n:.0f}%" for r, v in stalls.most_common(5))
        lines.append(f"{s.label:18s} {s.first:#6x} {s.samples:8d} {100 * s.samples / total:5.1f}% {s.executed:11d}  {reasons}")
    loops = wait_loops(instructions, parts)
    if loops:
        lines.append("out-of-line waits: loop, returns to (segment), spins, exits, spins per exit")
        for head, target, owner, spins, exits in loops:
            lines.append(f"  {head:#x} -> {target:#x} ({owner}): {spins} spins, {exits} exits, "
                         f"{spins / exits if exits else 0.:.1f}")
    lines.append(f"top {top} instructions by samples (segment, two largest reasons)")
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        reasons = ", ".join(f"{r} {v}" for r, v in ins.stalls.most_common(2))
        lines.append(f"  {ins.samples:7d} {ins.address:#x} [{segment_of(parts, ins.address)}] {ins.text[:64]:64s} {reasons}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source_csv", nargs="+")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top: at least 0, got {args.top}")
    for path in args.source_csv:
        print(summary(path, args.top))


if __name__ == "__main__":
    sys.exit(main())
