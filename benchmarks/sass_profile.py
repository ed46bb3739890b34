"""Offline SASS profile of a spec's kernels for sm_90 (no GPU; backward launches, forward too with --phases): counts and a time model.

Every backward launch of ``chunk_<spec>`` at one shape is recorded (``gdngen.compilecheck``:
exactly the kernels, tiles and constexprs the runtime picks), compiled for sm_90 and disassembled
with Triton's bundled ``nvdisasm``. Per kernel it reports, per warp and program (loop bodies times
their trip counts): instructions in total and by class (MUFU.EX2, HMMA/HGMMA, LDG/LDGSTS, STG,
LDS/LDSM, STS/STSM, BAR, SHFL), registers and spills (``ptxas -v``), shared memory, occupancy, and
three lower bounds on an H200 (132 SMs, 1.98 GHz):

* issue: warp instructions / (132 SMs x 4 schedulers x clock);
* ex2: MUFU.EX2 warp instructions / (132 x 4 SMSPs x 0.5 per clock);
* model: waves x max(one warp's critical path, issue of the warps sharing a scheduler) (a launch with the
  PERSISTENT tile option: 132 x PERSISTENT programs, the tile loop run tiles / programs times). The
  critical path replays the SASS in order with its control bits (stall counts, scoreboards):
  fixed-latency ops cost their stall count, scoreboarded ones their assumed latency (LDG
  ``--ldg`` cycles, LDS 30, SHFL 25, MUFU 18, BAR.SYNC 20, wgmma by its FLOPs at 4096/clock + 60).
  It ignores contention between warps, bank conflicts and cache misses: a lower bound.
  Asynchronous copies (cp.async, LDGSTS) cost nothing there unless ``--cp-async``: then their
  groups land ``--ldg`` cycles after issue, ``DEPBAR.LE SB0, n`` waits for them, and loop bodies are
  replayed in steady state (a step waits for copies issued one or more steps earlier). Without it
  a pass whose pipeliner waits at the top of each step for the copies issued at the end of the step
  before (two stages) looks as fast as one that overlaps them (benchmarks/NOTES.md, "GDN's reverse
  state pass waited for its loads").

Loop trip counts are not in the SASS; ``trips`` below gives them per kernel (from the sources),
and ``grid`` the launch grid at the profiled shape; kernels without a rule there (the forward's
wy and l2norm launches) are left out.

Run with Triton 3.6 (the H200's), e.g.::

    PYTHONPATH=/tmp/tri36/site:. python benchmarks/sass_profile.py --specs gla,simple_gla
    PYTHONPATH=/tmp/tri36/site:. python benchmarks/sass_profile.py --specs gla \
        --override '{"chunk": {"BV": 128}}' --json out.json

Written for benchmarks/results/2026-11-30-offline-gla-backward-sass.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMS, CLK = 132, 1.98e9
LAT = dict(ldg=300, lds=30, shfl=25, mufu=18, bar=20, read=6, other=20, tc_flops_per_clk=4096, hgmma_lat=60)
CLASSES = [("ex2", ("MUFU.EX2",)), ("mma", ("HMMA", "HGMMA")), ("ldg", ("LDG.", "LDGSTS")), ("stg", ("STG",)),
           ("lds", ("LDS", "LDSM")), ("sts", ("STS", "STSM")), ("bar", ("BAR",)), ("shfl", ("SHFL",))]


def nvdisasm() -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def decode(cubin: bytes) -> tuple[list[dict], dict]:
    """Instructions (op, args, predicate, control bits) and label -> index of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        lines = subprocess.run([nvdisasm(), "-hex", "-c", handle.name], capture_output=True, text=True).stdout.splitlines()
    finally:
        os.unlink(handle.name)
    ins, labels, i = [], {}, 0
    while i < len(lines):
        label = re.match(r"^\s*(\.L_x_\d+):", lines[i])
        if label:
            labels[label.group(1)] = len(ins)
            i += 1
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s+/\* 0x[0-9a-f]{16} \*/", lines[i])
        if m:
            hi = int(re.search(r"/\* 0x([0-9a-f]{16}) \*/", lines[i + 1]).group(1), 16)
            text = m.group(2).strip()
            pm = re.match(r"(@!?U?P[T0-9]+)\s+(.*)", text)
            body = pm.group(2) if pm else text
            op = body.split()[0]
            c = hi >> 41            # Volta+ control bits: stall, yield, write/read scoreboard, wait mask
            ins.append(dict(op=op, args=body[len(op):].strip(), pred=pm.group(1) if pm else "", stall=c & 0xF,
                            wb=(c >> 5) & 7, rb=(c >> 8) & 7, wait=(c >> 11) & 0x3F))
            i += 2
            continue
        i += 1
    return ins, labels


def loops(ins, labels) -> list[tuple[int, int]]:
    """[start, end) of every loop: a predicated branch back to an earlier label."""
    out = []
    for i, x in enumerate(ins):
        m = re.search(r"(\.L_x_\d+)", x["args"]) if x["op"].startswith("BRA") and x["pred"] else None
        if m and labels.get(m.group(1)) is not None and labels[m.group(1)] <= i:
            out.append((labels[m.group(1)], i + 1))
    return out


def counts(ins, lo, hi) -> collections.Counter:
    c = collections.Counter()
    for x in ins[lo:hi]:
        if x["op"] == "NOP":
            continue
        c["total"] += 1
        for name, prefixes in CLASSES:
            if x["op"].startswith(prefixes):
                c[name] += 1
    return c


def critical_path(ins, lo, hi, lat, state=None) -> float:
    """Cycles one warp needs to issue ins[lo:hi] alone (in order, control bits, assumed latencies).

    With ``lat["cp_async"]`` set, asynchronous copies (LDGSTS, cp.async) are modelled too: each
    LDGDEPBAR closes a group that lands ``lat["ldg"]`` cycles after its last copy issued (groups
    land in order), and ``DEPBAR.LE SB0, n`` waits until at most n groups are in flight. Without
    it those waits cost nothing (the model before 2026-11-30's gdn-state-prefetch). ``state``
    (a dict) carries time, scoreboards and groups from one replay into the next (loop bodies in
    steady state: see :func:`loop_path`)."""
    st = state if state is not None else {}
    t, sb, hg_busy, gsb = st.get("t", 0.0), st.get("sb", [0.0] * 6), st.get("hg_busy", 0.0), st.get("gsb", 0.0)
    groups, pending = st.get("groups", []), st.get("pending", None)
    cp_async = lat.get("cp_async", 0)
    for x in ins[lo:hi]:
        op = x["op"]
        if op == "NOP":
            continue
        for i in range(6):
            if x["wait"] >> i & 1:
                t = max(t, sb[i])
        if cp_async and op.startswith("DEPBAR.LE"):
            m = re.match(r"SB0,\s*(0x[0-9a-f]+|\d+)", x["args"])
            if m:
                keep = int(m.group(1), 0)
                if len(groups) > keep:
                    t = max(t, groups[len(groups) - keep - 1])
                groups = groups[len(groups) - keep:] if keep else []
        if cp_async and op.startswith("LDGSTS"):
            pending = max(pending or 0.0, t)
        if cp_async and op.startswith("LDGDEPBAR"):
            done = (pending if pending is not None else t) + lat["ldg"]
            groups = groups + [max(done, groups[-1] if groups else 0.0)]
            pending = None
        if op.startswith("WARPGROUP.DEPBAR"):
            t = max(t, gsb)
        if op.startswith("BAR.SYNC"):
            t += lat["bar"]
        if op.startswith("HGMMA"):
            mm, nn, kk = map(int, re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op).groups())
            hg_busy = max(hg_busy, t) + 2 * mm * nn * kk / lat["tc_flops_per_clk"]
            gsb = hg_busy + lat["hgmma_lat"]
        if x["wb"] != 7:
            kind = ("ldg" if op.startswith("LDG") and not op.startswith("LDGDEPBAR") else
                    "lds" if op.startswith(("LDS", "LDSM")) else "shfl" if op.startswith("SHFL") else
                    "mufu" if op.startswith("MUFU") else "other")
            sb[x["wb"]] = max(sb[x["wb"]], t + (0 if op.startswith("LDGDEPBAR") else lat[kind]))
        if x["rb"] != 7:
            sb[x["rb"]] = max(sb[x["rb"]], t + lat["read"])
        t += max(x["stall"], 1)
    st.update(t=t, sb=sb, hg_busy=hg_busy, gsb=gsb, groups=groups, pending=pending)
    return t - state.get("t0", 0.0) if state is not None else t


def loop_path(ins, lo, hi, lat, repeats=4) -> float:
    """Cycles of one loop body in steady state with ``lat["cp_async"]``: the body replayed
    ``repeats`` times, carrying the copies in flight from one iteration into the next; the last
    iteration's cycles. Without it the body alone (critical_path)."""
    if not lat.get("cp_async"):
        return critical_path(ins, lo, hi, lat)
    state = {}
    for _ in range(repeats):
        state["t0"] = state.get("t", 0.0)
        cycles = critical_path(ins, lo, hi, lat, state)
    return cycles


def weighted(ins, lp, trips, fn):
    """fn over the whole kernel with every loop body counted trips (times its parents') times."""
    total = fn(0, len(ins))
    for i, (a, b) in enumerate(lp):
        parent = math.prod(trips[j] for j, (c, d) in enumerate(lp) if j != i and c <= a and b <= d)
        extra = parent * trips[i] - parent
        body = fn(a, b)
        if isinstance(total, collections.Counter):
            total.update({k: v * extra for k, v in body.items()})
        else:
            total += body * extra
    return total


def trips(name, ins, lp, args, *, K, V, BT, NT) -> list[int]:
    """Trip counts of the loops (from the kernel sources)."""
    def has(a, b, *ops):
        return any(x["op"].startswith(ops) for x in ins[a:b])
    out = []
    for a, b in lp:
        if "_state_bwd" in name or "_state_fwd" in name:
            out.append(NT)                                   # sequential pass over the chunks
        elif "_output_fwd_kernel_bt" in name or "_intra_bwd_kernel_bt" in name:
            # per-channel scores. Since 2026-11-30: first a loop over the log2(BT) levels (a loop over
            # the K tiles inside it, unrolled at small BK), then K-tile passes (state term, diagonal
            # row sums) and intra's value tiles (they store). Before: K tiles around a 16-step
            # column loop (exponents, no dots), then intra's value tiles.
            top = [(c, d) for c, d in lp if not any(e <= c and d <= f and (e, f) != (c, d) for e, f in lp)]
            column = [not has(c, d, "HGMMA", "HMMA") and has(c, d, "MUFU") for c, d in lp]
            if len(lp) == 1 and "_output_fwd" in name:
                # the delta rule's output with the wy stage's scores (aqk_from_wy): one pass over K tiles
                out.append(math.ceil(K / args["BK"]))
            elif column[lp.index((a, b))]:
                out.append(16)
            elif any(column):
                out.append(math.ceil(V / args["BV"]) if "_intra_bwd" in name and not has(a, b, "MUFU")
                           else math.ceil(K / args["BK"]))
            elif (a, b) == min(top):
                out.append(int(math.log2(BT)))
            elif "_intra_bwd" in name and has(a, b, "STG"):
                out.append(math.ceil(V / args["BV"]))
            else:
                out.append(math.ceil(K / args["BK"]))
        elif "_intra_bwd" in name:                           # scalar: K tiles (scores), then, since
            out.append(math.ceil(V / args["BV"]) if has(a, b, "STG")   # gdn-bwd-rowfactors, the value
                       else math.ceil(K / args["BK"]))                # tiles in the same program
        elif "_chunk_bwd_kernel_bt" in name:
            if any(not has(c, d, "HGMMA", "HMMA") for c, d in lp):   # before 2026-11-30: 16 diagonal
                out.append(BT // 16 - 1 if has(a, b, "HGMMA", "HMMA") else 16)   # columns, block rows
            else:                                                    # levels (exp inside), V tiles
                out.append(int(math.log2(BT)) if has(a, b, "MUFU") else math.ceil(V / args["BV"]))
        elif "_wy_decay" in name:                            # K tiles (they store) around the log2(BT)
            inner = [(c, d) for c, d in lp if not has(c, d, "STG")]          # levels (since kda-wy-levels:
            out.append(math.ceil(K / args["BK"]) if has(a, b, "STG") else        # one inner loop) or
                       int(math.log2(BT)) if len(inner) == 1 else                # column blocks BT/16 - 1
                       BT // 16 - 1 if has(a, b, "HGMMA", "HMMA") else 16)      # (dots) and columns 16
        elif "_wy_" in name:                                 # per-channel forward: K tiles around
            nested = any(c <= a and b <= d and (c, d) != (a, b) for c, d in lp)   # the log2(BT) levels
            out.append(math.ceil(K / args["BK"]) if not nested else              # (dots, since kda-wy-levels)
                       int(math.log2(BT)) if has(a, b, "HGMMA", "HMMA") else 9)   # or 9 column steps
        else:
            out.append(1)
    return out


def grid(name, args, *, B, HV, K, V, NT):
    if "_output_fwd" in name:
        return (math.ceil(V / args["BV"]), NT, B * HV)
    if "_state_fwd" in name:
        return (math.ceil(V / args["BV"]), B * HV)
    if "_intra_bwd_kernel_bt" in name:
        return (1, NT, B * HV)             # per-channel: every value tile in one program (2026-11-30)
    if "_intra_bwd" in name:
        return (1, NT, B * HV)             # scalar too since gdn-bwd-rowfactors (one score tile per chunk)
    if "_state_bwd" in name:
        return (math.ceil(V / args["BV"]), B * HV)
    if "_chunk_bwd" in name:
        return (math.ceil(K / args["BK"]), NT, B * HV)
    if "_gates" in name:
        return (NT, B, math.ceil(args["HV"] / args["BH"]))
    if "_wy_" in name:
        return (NT, B * HV)
    return None


def occupancy(regs, warps, shared):
    per_warp = math.ceil(regs * 32 / 256) * 256
    return max(0, min(65536 // (per_warp * warps), 233472 // (shared + 1024), 64 // warps, 32))


@contextlib.contextmanager
def _patched(owner, name, value):
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


def profile(specs, *, B, T, H, HV, K, V, BT, dtype, overrides, lat, phases=("bwd",)):
    import triton
    from triton.compiler import ASTSource
    from gdngen import compilecheck as cc
    from gdngen.runtime import backward_tiles as bt
    tiles = importlib.import_module("gdngen.runtime.tiles")
    from gdngen.spec import catalogue, load_spec
    NT = T // BT
    rows = []
    with contextlib.ExitStack() as stack:
        # forward stages by name; backward ones as "chunk", "intra", ... or, where a forward stage has the
        # same name, with a suffix: "wy_bwd", "state_bwd"
        for stage, config in overrides.items():
            if stage in ("output", "state", "state_output", "wy", "fused_output", "state_pieces", "store_wu", "keep_values"):
                for name in specs:
                    stack.enter_context(tiles.override(name, stage, **config))
            else:
                stack.enter_context(bt.override_backward(stage.removesuffix("_bwd"), **config))
        if overrides.get("fused_output", {}).get("value"):
            # the fused output runs only in a forward that keeps nothing for a backward
            from gdngen.runtime.ops import keeping_states
            stack.enter_context(keeping_states(False))
        for spec in [load_spec(p) for p in catalogue()]:
            if spec.name not in specs:
                continue
            module = importlib.import_module(f"generated.{spec.name}")
            if hasattr(module, "tma_config"):
                # the launches are recorded on CPU tensors for an sm_90 target: a config's TMA stands
                stack.enter_context(_patched(module, "tma_config", lambda config, *tensors, sizes=(): config))
            seen = set()
            for phase, launch in cc.capture(spec, module, cc.Shape(K, V, BT, dtype, B, H, HV)):
                key = cc._key(launch)
                if phase not in phases or key in seen:
                    continue
                seen.add(key)
                name = launch.fn.__name__
                g = grid(name, launch.args, B=B, HV=HV, K=K, V=V, NT=NT)
                if g is None:
                    continue
                signature, constexprs, attrs = cc._signature(launch)
                compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=cc._target(),
                                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
                    handle.write(compiled.asm["ptx"])
                info = subprocess.run([cc.ptxas_path(), "-v", "-arch=sm_90a", handle.name, "-o", os.devnull],
                                      capture_output=True, text=True).stderr
                os.unlink(handle.name)
                regs = int(re.findall(r"Used (\d+) registers", info)[0])
                spill = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info))
                ins, labels = decode(compiled.asm["cubin"])
                lp = loops(ins, labels)
                tr = trips(name, ins, lp, launch.args, K=K, V=V, BT=BT, NT=NT)
                per_sm = launch.args.get("PERSISTENT")
                if per_sm:
                    # a persistent launch (stages/_persistent.j2): SMS x PERSISTENT programs, each looping over
                    # its share of the tiles; the tile loop is the outermost loop (these kernels have no other)
                    tiles_total = math.prod(g)
                    g = (min(tiles_total, SMS * int(per_sm)),)
                    outer = max(range(len(lp)), key=lambda i: lp[i][1] - lp[i][0]) if lp else None
                    if outer is not None:
                        tr[outer] = math.ceil(tiles_total / g[0])
                per_warp = weighted(ins, lp, tr, lambda a, b: counts(ins, a, b))
                path = weighted(ins, lp, tr, lambda a, b: (critical_path(ins, a, b, lat) if (a, b) == (0, len(ins))
                                                           else loop_path(ins, a, b, lat)))
                w, shared = launch.num_warps, compiled.metadata.shared
                programs, occ = math.prod(g), occupancy(regs, w, compiled.metadata.shared)
                waves = math.ceil(programs / (SMS * occ)) if occ else math.inf     # does not fit
                rows.append(dict(
                    spec=spec.name, phase=phase, kernel=name, config=cc._launch_config(launch), grid=g, programs=programs,
                    regs=regs, spill=spill, shared=shared, warps=w, ctas_per_sm=occ, waves=waves,
                    loops=[(a, b, t) for (a, b), t in zip(lp, tr)], per_warp=dict(per_warp),
                    critical_path_cycles=round(path),
                    issue_ms=per_warp["total"] * w * programs / (SMS * 4 * CLK) * 1e3,
                    ex2_ms=per_warp["ex2"] * w * programs / (SMS * 4 * 0.5 * CLK) * 1e3,
                    model_ms=waves * max(path, occ * w / 4 * per_warp["total"]) / CLK * 1e3))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="gla,simple_gla")
    parser.add_argument("--shape", default="4,8192,16,16,128,128", help="B,T,H,HV,K,V")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--override", default="{}", help='tiles per stage, e.g. {"chunk": {"BV": 128}, "output": {"num_warps": 8}, "wy_bwd": {"num_warps": 8}} '
                        '(wy and state name the forward stages; wy_bwd and state_bwd the backward ones)')
    parser.add_argument("--latency", default="{}", help='model latencies, e.g. {"ldg": 600, "bar": 40}')
    parser.add_argument("--phases", default="bwd", help="compilecheck phases to profile, e.g. fwd,bwd")
    parser.add_argument("--cp-async", action="store_true",
                        help="model asynchronous copies (cp.async groups and their DEPBAR waits, loop bodies in steady "
                             "state); off by default, as in the figures before 2026-11-30")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    B, T, H, HV, K, V = map(int, args.shape.split(","))
    rows = profile(args.specs.split(","), B=B, T=T, H=H, HV=HV, K=K, V=V, BT=args.chunk, dtype=args.dtype,
                   overrides=json.loads(args.override),
                   lat={**LAT, **json.loads(args.latency), **({"cp_async": 1} if args.cp_async else {})},
                   phases=tuple(args.phases.split(",")))
    print("| spec | phase | kernel | tiles | grid | regs | spill | CTA/SM | instr | EX2 | MMA | LDG | STG | LDS | STS | BAR "
          "| SHFL | issue ms | model ms |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p = r["per_warp"]
        print(f"| {r['spec']} | {r['phase']} | {r['kernel']} | {r['config']} | {'x'.join(map(str, r['grid']))} | {r['regs']} "
              f"| {r['spill']} | {r['ctas_per_sm']} | {p.get('total', 0)} | {p.get('ex2', 0)} | {p.get('mma', 0)} "
              f"| {p.get('ldg', 0)} | {p.get('stg', 0)} | {p.get('lds', 0)} | {p.get('sts', 0)} | {p.get('bar', 0)} "
              f"| {p.get('shfl', 0)} | {r['issue_ms']:.3f} | {r['model_ms']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
