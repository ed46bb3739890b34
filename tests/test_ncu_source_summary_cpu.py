"""benchmarks/ncu_source_summary.py on a hand-made source page: partitions split at USETMAXREG, stall
samples summed per partition, out-of-line mbarrier loops found with the partition they return to."""
import csv

import pytest

from benchmarks.ncu_source_summary import read_source_page, read_source_pages, segments, summary, wait_loops

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
BASE = 0x7F0000001000


def _row(offset, text, samples=0, executed=0, long_sb=0, wait=0):
    return [f"{BASE + offset:#x}", f"      {text}", str(samples), str(samples), str(executed), str(long_sb),
            str(wait), str(long_sb)]


def _page(tmp_path, rows):
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "_kernel"])
        writer.writerow(HEADER)
        writer.writerows(rows)
    return str(path)


@pytest.fixture
def page(tmp_path):
    loop = BASE + 0x100
    return _page(tmp_path, [
        _row(0x00, "LDC R1, c[0x0][0x28]", samples=1, executed=8, wait=1),
        _row(0x10, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0", executed=4),
        _row(0x20, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x20], R3", executed=40),
        _row(0x30, f"@!P0  BRA {loop:#x}", samples=30, executed=40, long_sb=30),
        _row(0x40, "FADD R2, R3, -R4", samples=5, executed=40, wait=5),
        _row(0x50, "USETMAXREG.DEALLOC.CTAPOOL 0x58", executed=4),
        _row(0x60, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ", samples=12, executed=40, wait=2, long_sb=10),
        _row(0x70, "EXIT", executed=8),
        # the out-of-line retry loop of the wait at +0x20: spun 90 times, left 10 times back to +0x40
        _row(0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x20], R3", executed=90),
        _row(0x110, f"@!P0  BRA {loop:#x}", executed=90),
        _row(0x120, f"BRA {BASE + 0x40:#x}", executed=10),
    ])


def test_partitions_and_their_samples(page):
    instructions = read_source_page(page)
    parts = segments(instructions)
    assert [p.label for p in parts] == ["prologue", "try_alloc 208 regs", "dealloc 88 regs"]
    assert [p.samples for p in parts] == [1, 35, 12]
    assert parts[1].stalls() == {"long_sb": 30, "wait": 5}
    assert parts[2].executed == 4 + 40 + 8 + 90 + 90 + 10     # the loops sit after the last partition's code


def test_wait_loops_return_to_their_partition(page):
    instructions = read_source_page(page)
    loops = wait_loops(instructions, segments(instructions))
    assert loops == [(BASE + 0x100, BASE + 0x40, "try_alloc 208 regs", 90, 10)]


def test_report_text(page):
    text = summary(page, top=2)
    assert "48 samples" in text and "90 spins, 10 exits, 9.0" in text
    assert "0x100 -> 0x40 (try_alloc 208 regs)" in text        # offsets from the kernel's first instruction
    assert text.splitlines()[-2].split()[:2] == ["30", "0x30"]  # the largest sample count first


def test_a_page_without_source_counters_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('"Kernel Name","_kernel"\n"Address","Source","Instructions Executed"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        read_source_page(str(path))


def test_a_page_of_several_launches_is_summarised_per_launch(tmp_path):
    """A report of several kernels (or of one launched twice) prints one page after another; each is its own
    section, its addresses from its own first instruction."""
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for name, samples in (("_first", 7), ("_second", 11)):
            writer.writerow(["Kernel Name", name])
            writer.writerow(HEADER)
            writer.writerows([_row(0x00, "LDC R1, c[0x0][0x28]", samples=samples, executed=8, wait=samples),
                              _row(0x10, "EXIT", executed=8)])
    pages = read_source_pages(str(path))
    assert [(name, [i.samples for i in ins]) for name, ins in pages] == [("_first", [7, 0]), ("_second", [11, 0])]
    text = summary(str(path), top=1)
    assert "[_first, launch 1 of 2]: 2 instructions, 7 samples" in text
    assert "[_second, launch 2 of 2]: 2 instructions, 11 samples" in text
