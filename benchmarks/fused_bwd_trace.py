"""Where a chunk's time goes in the fused backward (stop 66): each consumer's arrival at every step's barrier and
its release from it, read from the SM's cycle counter (%clock64).

The fused kernel (templates/stages/backward_fused_gluon.py.j2) runs three consumers in lockstep: a chunk takes the
sum over its seven steps of the slowest consumer's share, plus the barriers' own latency. This copies the built
module, has every ``_fused_meet`` of the three consumers record its two cycle counts for the first programs'
chunks into a device buffer (its address baked into the copy), runs the backward, and prints, per step, the median
cycles of the step, of each consumer's work in it, of the barrier's wake-up after the last arrival, and which
consumer arrived last. ``--marks`` adds probe points inside steps: "K:text" records the K consumer's counter
where it reaches the first line of its body holding ``text`` (a statement's first line), reported as cycles into
its step. The copy is a measuring instrument: the module under test is not changed.

    python benchmarks/fused_bwd_trace.py [--cases "8,2048,16,16 4,8192,16,32"] [--marks "K:b_x = b_x * b_ku"]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CONSUMERS = ("_fused_state", "_fused_keys", "_fused_scores")     # S, K, A in docs/fused_backward.md section 11
NAMES = ("S", "K", "A")
NSTEP = 7
MARKS_MAX = 32

TRACED_MEET = '''

@gluon_jit
def _fused_arrive_traced(steps, s: gl.constexpr, who: gl.constexpr, i):
    """_fused_arrive, recording this consumer's cycle counter at its arrival (measuring copy)."""
    t_arrive = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    fence_async_shared()
    mbarrier.arrive(steps.index(s), count=1)
    pid = gl.program_id(0)
    if (pid < PROGRAMS) & (i < CHUNKS):
        base = (pid.to(gl.int64) * 0 + ADDRESS).to(gl.pointer_type(gl.int64))
        gl.store(base + (((pid * CHUNKS + i) * 3 + who) * 7 + s) * 2, t_arrive)


@gluon_jit
def _fused_wait_traced(steps, s: gl.constexpr, phase, who: gl.constexpr, i):
    """The wait for step s's end, recording this consumer's cycle counter at its release (measuring copy)."""
    mbarrier.wait(steps.index(s), phase)
    t_release = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    pid = gl.program_id(0)
    if (pid < PROGRAMS) & (i < CHUNKS):
        base = (pid.to(gl.int64) * 0 + ADDRESS).to(gl.pointer_type(gl.int64))
        gl.store(base + (((pid * CHUNKS + i) * 3 + who) * 7 + s) * 2 + 1, t_release)
        if s == 6:
            if who == 0:
                # the chunk's end in ns too: cycles over ns is the clock the SM ran at
                t_ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                                 is_pure=False, pack=1)
                ns_base = (pid.to(gl.int64) * 0 + NS_ADDRESS).to(gl.pointer_type(gl.int64))
                gl.store(ns_base + pid * CHUNKS + i, t_ns)


@gluon_jit
def _fused_meet_traced(steps, s: gl.constexpr, phase, who: gl.constexpr, i):
    """_fused_meet, recording this consumer's arrival and release (measuring copy); a consumer that works on after
    its arrival (_fused_arrive, then mbarrier.wait) records the two apart."""
    _fused_arrive_traced(steps, s, who, i)
    _fused_wait_traced(steps, s, phase, who, i)


@gluon_jit
def _fused_mark(who: gl.constexpr, m: gl.constexpr, i):
    """This consumer's cycle counter at probe point m (measuring copy)."""
    t_here = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    pid = gl.program_id(0)
    if (pid < PROGRAMS) & (i < CHUNKS):
        base = (pid.to(gl.int64) * 0 + MARK_ADDRESS).to(gl.pointer_type(gl.int64))
        gl.store(base + ((pid * CHUNKS + i) * 3 + who) * MARKS_MAX + m, t_here)
'''


def parse_marks(text: str) -> list:
    """``--marks`` text, ";"-separated "S|K|A:text of a line" (a newline at the end allowed), as (consumer index,
    text) pairs."""
    return [(NAMES.index(m.split(":", 1)[0]), m.split(":", 1)[1]) for m in text.strip().split(";") if m]


def traced_source(source: str, address: int, programs: int, chunks: int, marks=(), mark_address: int = 0,
                  ns_address: int = 0) -> str:
    """The module's source with the three consumers' meets recording into the buffer at ``address``, each chunk's
    end in ns (%globaltimer) into the one at ``ns_address``, and a probe before the first line holding each mark's
    text ((consumer index, text) pairs) into the one at ``mark_address``."""
    head, sep, rest = source.partition("\n\n@gluon_jit\ndef _fused_producer(")
    if not sep:
        raise ValueError("the module has no fused backward (_fused_producer)")
    meet = (TRACED_MEET.replace("PROGRAMS", str(programs)).replace("CHUNKS", str(chunks))
            .replace("MARKS_MAX", str(MARKS_MAX)).replace("MARK_ADDRESS", str(mark_address))
            .replace("NS_ADDRESS", str(ns_address)).replace("ADDRESS", str(address)))
    if len(marks) > MARKS_MAX:
        raise ValueError(f"marks: at most {MARKS_MAX}, got {len(marks)}")
    rest = sep + rest
    for who, name in enumerate(CONSUMERS):
        start = rest.index(f"def {name}(")
        end = rest.index("\n@gluon_jit\n", start)
        lines = rest[start:end].split("\n")
        for m, (mark_who, text) in enumerate(marks):
            if mark_who != who:
                continue
            at = next((j for j, line in enumerate(lines) if text in line and "_fused_mark(" not in line), None)
            if at is None:
                raise ValueError(f"marks: no line of {name} holds {text!r}")
            indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
            lines.insert(at, f"{indent}_fused_mark({who}, {m}, i)")
        body, n = re.subn(r"_fused_meet\(steps, (\d), ph\)", rf"_fused_meet_traced(steps, \1, ph, {who}, i)",
                          "\n".join(lines))
        # a step's end split in two (a consumer that works on after its arrival): its arrival and its wait
        body, arrivals = re.subn(r"_fused_arrive\(steps, (\d)\)", rf"_fused_arrive_traced(steps, \1, {who}, i)", body)
        body, waits = re.subn(r"mbarrier\.wait\(steps\.index\((\d)\), ph\)",
                              rf"_fused_wait_traced(steps, \1, ph, {who}, i)", body)
        # a step may end in each branch of a constexpr choice (the S consumer's steps 4-5): count the steps
        ends = set(re.findall(r"_fused_(?:meet|arrive)_traced\(steps, (\d)", body))
        if ends != set(map(str, range(NSTEP))) or waits != arrivals:
            raise ValueError(f"{name}: steps {sorted(ends)} end ({n} meets, {arrivals} arrivals, {waits} waits), "
                             f"expected {NSTEP} steps")
        rest = rest[:start] + body + rest[end:]
    return head + meet + rest


def mark_steps(traced: str, marks) -> list:
    """Each mark's step: the steps that end before its probe in its consumer's body (counted once where both
    branches of a constexpr choice end them, the S consumer's steps 4-5; a mark inside those branches is not
    supported)."""
    steps = []
    for m, (who, _) in enumerate(marks):
        body = traced[traced.index(f"def {CONSUMERS[who]}("):]
        body = body[:body.index(f"_fused_mark({who}, {m}, i)")]
        steps.append(len(set(re.findall(r"_fused_(?:meet|arrive)_traced\(steps, (\d)", body))))
    return steps


def summarise_marks(trace: torch.Tensor, marks_trace: torch.Tensor, marks, steps, nt: int) -> list:
    """Per mark: the median cycles from its consumer's release into the step (the previous step's) to the probe."""
    t, k = trace.cpu().long(), marks_trace.cpu().long()
    rows = []
    for m, ((who, text), s) in enumerate(zip(marks, steps)):
        into = []
        for p in range(t.shape[0]):
            for i in range(1, min(t.shape[1], nt - 1)):
                release = t[p, i, who, s - 1, 1] if s > 0 else t[p, i - 1, who, NSTEP - 1, 1]
                into.append(int(k[p, i, who, m] - release))
        rows.append(dict(mark=f"{NAMES[who]}:{text}", step=s, cycles_into_step=statistics.median(into)))
    return rows


def summarise(trace: torch.Tensor, nt: int):
    """Per step: medians over the traced (program, chunk) pairs, chunks 1 .. nt - 2 (away from the ends)."""
    t = trace.cpu().long()                                     # [P, C, 3, 7, 2]
    rows, chunk_cycles = [], []
    for s in range(NSTEP):
        length, work, wake, last = [], [[] for _ in NAMES], [], [0, 0, 0]
        for p in range(t.shape[0]):
            for i in range(1, min(t.shape[1], nt - 1)):
                arrive, release = t[p, i, :, s, 0], t[p, i, :, s, 1]
                prev = t[p, i, :, s - 1, 1] if s > 0 else t[p, i - 1, :, NSTEP - 1, 1]
                length.append(int(release.max() - prev.max()))
                for c in range(3):
                    work[c].append(int(arrive[c] - prev[c]))
                wake.append(int(release.max() - arrive.max()))
                last[int(arrive.argmax())] += 1
        rows.append(dict(step=s, cycles=statistics.median(length),
                         **{f"{n}_work": statistics.median(w) for n, w in zip(NAMES, work)},
                         wake=statistics.median(wake), last_arrival=dict(zip(NAMES, last))))
    for p in range(t.shape[0]):
        for i in range(2, min(t.shape[1], nt - 1)):
            chunk_cycles.append(int(t[p, i, :, NSTEP - 1, 1].max() - t[p, i - 1, :, NSTEP - 1, 1].max()))
    return rows, statistics.median(chunk_cycles)


def chunk_ends(trace: torch.Tensor):
    """Each traced program's chunk ends (S's release from step 6) in cycles, [P, C], and how many it recorded
    (its first ones)."""
    ends = trace[:, :, 0, NSTEP - 1, 1].cpu().double()
    return ends, (ends > 0).sum(1)


def program_times(trace: torch.Tensor, ns: torch.Tensor) -> dict:
    """Across the traced programs, from each one's chunk ends (S's release from step 6) past its first chunk: the
    mean and spread of a chunk in cycles and in ns, and the clock (cycles over ns). A median chunk that does not
    add up to the kernel's time shows here: slow chunks between fast ones, slow programs, or a lower clock."""
    ends, recorded = chunk_ends(trace)
    ns = ns.cpu().double()                                      # [P, C]
    per_chunk, per_chunk_ns, clocks, spans = [], [], [], []
    for p in range(ends.shape[0]):
        n = int(recorded[p])
        if n < 3:
            continue
        cyc, t = ends[p, 1:n].diff(), ns[p, 1:n].diff()
        per_chunk.append(cyc)
        per_chunk_ns.append(t)
        clocks.append(float(cyc.sum() / t.sum()) * 1e3)         # MHz
        spans.append(float(t.sum()) / 1e3)                      # us from the first chunk's end to the last's
    if not per_chunk:
        return {}
    cyc, t = torch.cat(per_chunk), torch.cat(per_chunk_ns)
    q = torch.tensor([0.1, 0.5, 0.9, 0.99], dtype=torch.float64)
    return dict(programs=len(per_chunk), chunk_cycles_mean=round(float(cyc.mean()), 1),
                chunk_cycles_quantiles=[round(float(v)) for v in cyc.quantile(q)],
                chunk_ns_mean=round(float(t.mean()), 1), chunk_ns_quantiles=[round(float(v)) for v in t.quantile(q)],
                clock_mhz_min_median_max=[round(min(clocks)), round(statistics.median(clocks)), round(max(clocks))],
                span_us_min_max=[round(min(spans), 1), round(max(spans), 1)])


def slowest_programs(trace: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` traced programs whose recorded chunks took longest a chunk (S's releases from step 6, past the
    first chunk), slowest first."""
    ends, recorded = chunk_ends(trace)
    first, last = ends[:, 1], ends.gather(1, (recorded - 1).clamp(min=0)[:, None])[:, 0]
    per_chunk = torch.where(recorded > 2, (last - first) / (recorded - 2).clamp(min=1), torch.zeros_like(first))
    return per_chunk.argsort(descending=True)[:n]


def print_steps(rows):
    """summarise's rows as a table."""
    print("step  cycles  " + "  ".join(f"{n}_work" for n in NAMES) + "  wake  last arrival (S/K/A)")
    for r in rows:
        la = r["last_arrival"]
        print(f"{r['step']:>4}  {r['cycles']:>6}  " + "  ".join(f"{r[n + '_work']:>6}" for n in NAMES)
              + f"  {r['wake']:>4}  {la['S']}/{la['K']}/{la['A']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8,2048,16,16 4,8192,16,32")
    parser.add_argument("--module", default=str(ROOT / "generated" / "gated_delta_rule.py"))
    parser.add_argument("--programs", type=int, default=4)
    parser.add_argument("--marks", default="", help='probe points, ";"-separated "S|K|A:text of a line"')
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--switches", default="", help='override switches set while tracing, e.g. '
                        '"gluon_fused_bwd=0" (comma-separated name=0|1)')
    args = parser.parse_args()
    from benchmarks.fused_probe import inputs, load_module
    from benchmarks.tuner_timing_check import kernel_times
    from gdngen.runtime import override

    chunks = 128
    marks = parse_marks(args.marks)
    trace = torch.zeros(args.programs, chunks, 3, NSTEP, 2, dtype=torch.int64, device="cuda")
    marks_trace = torch.zeros(args.programs, chunks, 3, MARKS_MAX, dtype=torch.int64, device="cuda")
    ns_trace = torch.zeros(args.programs, chunks, dtype=torch.int64, device="cuda")
    folder = Path(tempfile.mkdtemp(prefix="fused_trace_"))
    path = folder / "gated_delta_rule_traced.py"
    traced = traced_source(Path(args.module).read_text(), trace.data_ptr(), args.programs, chunks, marks,
                           marks_trace.data_ptr(), ns_trace.data_ptr())
    path.write_text(traced)
    steps = mark_steps(traced, marks)
    modules = dict(plain=load_module(Path(args.module), "gdr_plain"), traced=load_module(path, "gdr_traced"))
    out = open(Path(args.out) / "fused_bwd_trace.jsonl", "a")
    gpu = torch.cuda.get_device_name()
    for case in args.cases.split():
        B, T, H, HV = map(int, case.split(","))
        x = inputs(B, T, H, HV, grad=True)
        do = torch.randn(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)

        def step(module):
            o, _ = module.chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=False, output_final_state=False)
            o.backward(do)

        kernel_us = {}
        with contextlib.ExitStack() as switched:
            for item in filter(None, args.switches.split(",")):
                name, value = item.split("=")
                switched.enter_context(override("gated_delta_rule", name, value=bool(int(value))))
            switched.enter_context(override("gated_delta_rule", "gluon_fused_bwd", value=True))
            for label, module in modules.items():
                step(module)                                   # compile
                kernel_us[label] = kernel_times(lambda module=module: step(module), reps=10, grad=True).get(
                    "_fused_bwd_gluon_kernel")
            trace.zero_()
            marks_trace.zero_()
            ns_trace.zero_()
            with torch.enable_grad():
                step(modules["traced"])
            torch.cuda.synchronize()
        # the steps from the first four programs (a Python loop) and from the four slowest; the chunk times
        # from all traced
        rows, chunk = summarise(trace[:4], T // 64)
        mark_rows = summarise_marks(trace[:4], marks_trace[:4], marks, steps, T // 64)
        times = program_times(trace, ns_trace)
        slowest = slowest_programs(trace, 4)
        slow_rows, slow_chunk = summarise(trace[slowest], T // 64)
        record = dict(gpu=gpu, B=B, T=T, H=H, HV=HV, kernel_us=kernel_us, chunk_cycles=chunk, steps=rows,
                      marks=mark_rows, programs=times, slowest=dict(programs=slowest.tolist(),
                                                                    chunk_cycles=slow_chunk, steps=slow_rows))
        out.write(json.dumps(record) + "\n")
        out.flush()
        print(f"\n{gpu} ({B},{T},{H},{HV}): fused kernel {kernel_us['plain']} us (traced copy "
              f"{kernel_us['traced']}); a chunk {chunk} cycles")
        print_steps(rows)
        print("chunks (all traced programs): " + ", ".join(f"{k} {v}" for k, v in times.items()))
        print(f"the slowest programs {slowest.tolist()}: a chunk {slow_chunk} cycles")
        print_steps(slow_rows)
        for r in mark_rows:
            print(f"  step {r['step']}  +{r['cycles_into_step']:>7}  {r['mark']}")


if __name__ == "__main__":
    main()
