"""benchmarks/fused_bwd_trace.py: the measuring copy of the fused backward and the per-step summary (CPU)."""
import ast
import re
from pathlib import Path

import pytest
import torch

from benchmarks.fused_bwd_trace import NSTEP, summarise, traced_source

MODULE = Path(__file__).resolve().parent.parent / "generated" / "gated_delta_rule.py"


def test_traced_source_records_every_consumer_meet():
    source = MODULE.read_text()
    traced = traced_source(source, address=0x7F0000001000, programs=3, chunks=16)
    ast.parse(traced)
    assert "_fused_meet(steps," not in traced.split("def _fused_producer(")[1].split("def _fused_bwd_gluon_kernel(")[0]
    for who, name in enumerate(("_fused_state", "_fused_keys", "_fused_scores")):
        body = traced.split(f"def {name}(")[1].split("\n@gluon_jit\n")[0]
        # each step's end recorded: a meet, or (the A consumer's step 5) an arrival and a wait after more work
        recorded = [f"_fused_meet_traced(steps, {s}, ph, {who}, i)" in body
                    or (f"_fused_arrive_traced(steps, {s}, {who}, i)" in body
                        and f"_fused_wait_traced(steps, {s}, ph, {who}, i)" in body) for s in range(NSTEP)]
        assert recorded == [True] * NSTEP, name
        assert "_fused_arrive(steps," not in body and "mbarrier.wait(steps." not in body
    assert str(0x7F0000001000) in traced and "pid < 3" in traced and "i < 16" in traced
    # undone (the added functions out, the calls back), it is the module's text
    start = traced.index("\n\n@gluon_jit\ndef _fused_arrive_traced(")      # the first added function
    end = traced.index("\n\n@gluon_jit\ndef _fused_producer(")
    undone = re.sub(r"_fused_meet_traced\(steps, (\d), ph, \d, i\)", r"_fused_meet(steps, \1, ph)",
                    traced[:start] + traced[end:])
    undone = re.sub(r"_fused_arrive_traced\(steps, (\d), \d, i\)", r"_fused_arrive(steps, \1)", undone)
    undone = re.sub(r"_fused_wait_traced\(steps, (\d), ph, \d, i\)", r"mbarrier.wait(steps.index(\1), ph)", undone)
    assert undone == source

def test_traced_source_needs_the_fused_kernel():
    with pytest.raises(ValueError, match="_fused_producer"):
        traced_source("def f():\n    pass\n", 0, 1, 1)


def test_summary_takes_the_last_arrival_and_the_previous_release():
    # one program, 5 chunks of 1000 cycles; in step s consumer s % 3 arrives last, 100 + 10 s cycles in,
    # and every consumer is released 20 cycles after it
    trace = torch.zeros(1, 5, 3, NSTEP, 2, dtype=torch.int64)
    clock = 0
    for i in range(5):
        for s in range(NSTEP):
            start = clock
            for c in range(3):
                trace[0, i, c, s, 0] = start + (100 + 10 * s if c == s % 3 else 50)
            clock = start + 100 + 10 * s + 20
            trace[0, i, :, s, 1] = clock
        clock += 1000 - sum(120 + 10 * s for s in range(NSTEP))
        trace[0, i, :, NSTEP - 1, 1] = clock
    rows, chunk = summarise(trace, nt=5)
    assert chunk == 1000
    for s in range(NSTEP - 1):
        assert rows[s]["cycles"] == 120 + 10 * s and rows[s]["wake"] == 20
        assert rows[s]["last_arrival"] == {n: (3 if c == s % 3 else 0) for c, n in enumerate("SKA")}
        assert rows[s][f"{'SKA'[s % 3]}_work"] == 100 + 10 * s


def test_marks_go_before_their_lines_and_know_their_step():
    from benchmarks.fused_bwd_trace import mark_steps
    marks = [(1, "b_x = b_x * b_ku[:, None]"), (2, "drr_s.store"), (0, "vec_s.index(3).store(b_g_next")]
    traced = traced_source(MODULE.read_text(), 1, 2, 8, marks, mark_address=2)
    lines = traced.splitlines()
    for m, (who, text) in enumerate(marks):
        at = next(j for j, line in enumerate(lines) if f"_fused_mark({who}, {m}, i)" in line)
        assert text in lines[at + 1] and lines[at].startswith(lines[at + 1][:8])
    assert mark_steps(traced, marks) == [0, 2, 6]     # S's steps 4-5 end in both branches of GROUP_ADD
    with pytest.raises(ValueError, match="no line of _fused_keys"):
        traced_source(MODULE.read_text(), 1, 2, 8, [(1, "not a line of it")], 2)


def test_the_committed_marks_are_lines_of_the_module():
    """benchmarks/fused_bwd_trace_marks.txt, the probe points a device call passes to ``--marks``: each is a line of
    its consumer in the generated module (stop 67's first call with it failed on a line the kernel had lost)."""
    from benchmarks.fused_bwd_trace import MARKS_MAX, parse_marks
    marks = parse_marks((MODULE.parent.parent / "benchmarks" / "fused_bwd_trace_marks.txt").read_text())
    assert 0 < len(marks) <= MARKS_MAX
    traced = traced_source(MODULE.read_text(), 0x7F0000001000, 1, 4, marks, 0x7F0000002000)
    ast.parse(traced)


def test_program_times_give_the_mean_chunk_and_the_clock():
    # two programs: one of 6 chunks of 2000 cycles at 2 GHz (1000 ns), one of 4 chunks of 3000 cycles at 1.5 GHz
    # (2000 ns), the rest of the buffer unrecorded (zeros)
    from benchmarks.fused_bwd_trace import program_times
    trace = torch.zeros(3, 8, 3, NSTEP, 2, dtype=torch.int64)
    ns = torch.zeros(3, 8, dtype=torch.int64)
    for p, (n, cycles, ns_chunk) in enumerate([(6, 2000, 1000), (4, 3000, 2000)]):
        for i in range(n):
            trace[p, i, 0, NSTEP - 1, 1] = 10_000 + (i + 1) * cycles
            ns[p, i] = 5_000_000 + (i + 1) * ns_chunk
    times = program_times(trace, ns)
    # chunks past the first: 4 of the first program's, 2 of the second's
    assert times["programs"] == 2
    assert times["chunk_cycles_mean"] == round((4 * 2000 + 2 * 3000) / 6, 1)
    assert times["clock_mhz_min_median_max"] == [1500, 1750, 2000]
    assert times["span_us_min_max"] == [4.0, 4.0]
    assert program_times(trace[2:], ns[2:]) == {}


def test_slowest_programs_rank_by_their_mean_chunk():
    from benchmarks.fused_bwd_trace import slowest_programs
    trace = torch.zeros(4, 6, 3, NSTEP, 2, dtype=torch.int64)
    for p, (n, cycles) in enumerate([(6, 1000), (5, 3000), (2, 9000), (6, 2000)]):
        for i in range(n):
            trace[p, i, 0, NSTEP - 1, 1] = (i + 1) * cycles
    # program 2 recorded too few chunks to rank (0 a chunk)
    assert slowest_programs(trace, 3).tolist() == [1, 3, 0]
