"""Every Gluon kernel a generated module launches, compiled for the H200 (sm_90a) without a GPU: registers,
stack, spills and wgmma serialisation per warp-specialised partition.

    python benchmarks/offline_sm90.py --triton /tmp/t36x [--module gated_delta_rule] [--shape B,T,H,HV]
        [--mode fwd+bwd] [--switches "gluon_one_chain_bwd=1,gluon_reverse_wy=1"] [--kernel _reverse]
        [--set VALUES_REGS=152,SCORES_REGS=176] [--ptx-dir DIR] [--final-state] [--no-initial-state]
    python benchmarks/offline_sm90.py --triton /tmp/t36x --calls --kernel _state_output   # every call users make

The call asks for no final state (the benchmarks' call) unless ``--final-state``; a kernel that stores it compiles
apart, and the two can spill differently (stop 62). Before stop 62 a training step always asked for it.

Two processes:
1. record (TRITON_INTERPRET=1): the module's emulated copy (gdngen.runtime.gluon_emulator) runs one call at a small
   shape with K and V as the spec has them; each Gluon launch is recorded (its kernel, arguments' kinds and
   dtypes, descriptors' blocks, constexprs, options) instead of run. What a launch compiles to depends on
   those, not on the sequence length, so a small shape gives the kernels a large one runs (but for the tiles and
   state pieces a shape picks: ``--switches state_pieces=4``). The @triton.jit kernels run under the interpreter
   (the Gluon stages read their outputs); ``gdngen check --compile-sm90`` compiles those (gdngen.compilecheck,
   whose ptxas report this uses).
2. compile (the Triton at ``--triton``, the H200's version, no interpreter): each distinct launch is compiled
   by the real module's kernel for sm_90a (``compilecheck.compile_sm90``: Triton's own specialisation of the
   arguments); ``compilecheck.ptxas_report`` (ptxas -v) reports spills and "wgmma serialized" (C7512), and the SASS
   is split at each partition's setmaxnreg.

A row per kernel: registers, stack, shared memory, ptxas's spill bytes and C7512 note; then per partition its
setmaxnreg, instructions, local stores / loads, wgmma count and how many of them wait for the one before
(a serialised wgmma is followed at once by ``WARPGROUP.DEPBAR.LE gsb0, 0x0``).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- phase 1: record the launches ---------------------------------------------------------------------------

def _describe(value):
    """What a launch's compilation reads off one argument."""
    import torch
    from gdngen.runtime.gluon_emulator import TensorDescriptor
    if isinstance(value, TensorDescriptor):
        return ("desc", str(value.dtype), list(value.view.shape), list(value.block_type.shape))
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.data_ptr() % 16)
    if isinstance(value, torch.dtype):       # a constexpr dtype (the emulation's gl_dtype hands torch's)
        return ("gl_dtype", str(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    raise TypeError(f"argument of type {type(value).__name__}: not recordable")


def record(module_name: str, shape: tuple, kv: tuple, mode: str, switches: dict, final_state: bool = False,
           initial_state: bool = True) -> list:
    import contextlib
    import torch
    from gdngen.runtime import gluon_emulator, override
    from gdngen.runtime.gluon_emulator.language import EmulatedKernel
    from gdngen.selfcheck import call, make_inputs, training_gradients
    from gdngen.spec import load_spec
    launches = []

    def home(fn):
        """The module whose kernel this is: the emulated copy's are the real module's."""
        return fn.__module__.replace("__gluon_emulated", "")

    def launch(self, grid, args, kwargs):
        bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in self.signature.parameters})
        options = {k: v for k, v in kwargs.items() if k not in self.signature.parameters}
        launches.append((self.__name__, {n: _describe(v) for n, v in bound.arguments.items()}, options, home(self.fn)))

    module = gluon_emulator.load_module(module_name)
    spec = load_spec(os.path.join(ROOT, "specs", f"{module_name}.yaml"))
    B, T, H, HV = shape
    inputs = make_inputs(spec, B=B, T=T, H=H, HV=HV, K=kv[0], V=kv[1], dtype=torch.bfloat16, device="cpu",
                         h0=initial_state)
    run = EmulatedKernel.launch
    EmulatedKernel.launch = launch          # recorded, not run: the outputs are never read
    try:
        with contextlib.ExitStack() as stack:
            for name, value in switches.items():
                stack.enter_context(override(module_name, name, value=value))
            if mode == "fwd":
                with torch.no_grad():
                    call(module, spec, inputs, output_final_state=final_state)
            elif final_state:
                training_gradients(module, spec, inputs, seed=0)
            else:
                # a training step that asks for no final state (the benchmarks' call)
                leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
                          if isinstance(x, torch.Tensor) and x.is_floating_point()}
                o, _ = call(module, spec, {**inputs, **leaves})
                o.backward(torch.ones_like(o))
    finally:
        EmulatedKernel.launch = run
    return launches


# ---- phase 2: compile them ----------------------------------------------------------------------------------

def _argument(description):
    import torch
    from gdngen.runtime.gluon import gl_dtype, row_descriptor
    kind = description[0]
    if kind == "gl_dtype":
        return gl_dtype(getattr(torch, description[1].split(".")[1]))
    if kind == "desc":
        dtype, (rows, columns), block = getattr(torch, description[1].split(".")[1]), description[2], description[3]
        return row_descriptor(torch.empty(rows * columns, dtype=dtype), columns, block)
    if kind == "tensor":
        dtype, misalign = getattr(torch, description[1].split(".")[1]), description[2]
        base = torch.empty(64, dtype=dtype)
        return base[misalign // base.element_size():] if misalign else base
    return description[1]


# one instruction of nvdisasm's listing: its address and its text up to the semicolon
SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+([^;]*;)", re.M)


def _loop_ranges(sass: str) -> list:
    """The address ranges [label, branch] of the listing's predicated backward branches: its loops' bodies (a local
    load in one is paid every trip, as the pass's chunk loop paid stop 62's)."""
    labels, ranges, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        code = SASS_LINE.match(line)
        if not code:
            continue
        address = int(code.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        # a loop's back edge is predicated; the unconditional ones are the barrier waits' retry stubs at the
        # kernel's end jumping back to where they were called from
        target = re.search(r"^@!?U?P\w+\s+BRA\s+(?:\w+,\s*)?`\((\.L_x_\d+)\)", code.group(2).strip())
        if target and target.group(1) in labels and labels[target.group(1)] <= address:
            ranges.append((labels[target.group(1)], address))
    return ranges


def _partitions(sass: str) -> list:
    """nvdisasm's listing split where each partition sets its registers (ncu_source_summary.segments): per part
    its label, instructions, local stores and loads (and how many of them sit in a loop), wgmmas, and wgmmas
    waited for at once."""
    from collections import Counter
    from benchmarks.ncu_source_summary import Instruction, segments
    code = [Instruction(int(m.group(1), 16), m.group(2).strip(), 0, 0, Counter())
            for m in SASS_LINE.finditer(sass)]
    loops = _loop_ranges(sass)
    parts = []
    for segment in segments(code):
        ops = [re.sub(r"^@!?U?P\w+\s+", "", ins.text).split(" ")[0] for ins in segment.instructions]
        looped = [any(a <= ins.address <= b for a, b in loops) for ins in segment.instructions]
        parts.append(dict(regs=segment.label, n=len(ops), STL=sum(o.startswith("STL") for o in ops),
                          LDL=sum(o.startswith("LDL") for o in ops), wgmma=sum(o.startswith("HGMMA") for o in ops),
                          loop_STL=sum(o.startswith("STL") and inside for o, inside in zip(ops, looped)),
                          loop_LDL=sum(o.startswith("LDL") and inside for o, inside in zip(ops, looped)),
                          serial=sum(a.startswith("HGMMA") and b.startswith("WARPGROUP.DEPBAR")
                                     for a, b in zip(ops, ops[1:]))))
    return [p for p in parts if p["n"] > 40]


def _adjusted(launches: list, kernels: str, settings: dict) -> list:
    """The launches of kernels whose names contain ``kernels`` (all if empty), with ``settings`` (name -> int)
    replacing the constexprs and launch options of those names (a register split swept without a template edit)."""
    out = []
    for name, arguments, options, home in launches:
        if kernels and kernels not in name:
            continue
        arguments = {n: ("value", settings[n]) if n in settings and d[0] == "value" else d for n, d in arguments.items()}
        options = {n: settings.get(n, v) for n, v in options.items()}
        out.append((name, arguments, options, home))
    return out


def compile_report(kernel, values: dict, options: dict) -> tuple:
    """One launch of ``kernel`` (its arguments' ``values``, constexprs included; ``options``: maxnreg) compiled for
    sm_90a: (the compiled kernel, ptxas's report, nvdisasm's listing)."""
    import triton
    from gdngen.compilecheck import Launch, compile_sm90, ptxas_report
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # (num_warps: the Gluon kernels' constexpr, the launch's warps)
    compiled = compile_sm90(Launch(kernel, values, int(values.get("num_warps", 4)), 3),
                            **{k: v for k, v in options.items() if k not in ("num_warps", "num_stages")})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        report = ptxas_report(compiled.asm["ptx"], maxnreg=options.get("maxnreg"), cubin=cubin)
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    return compiled, report, sass


def compile_all(launches: list, ptx_dir: str | None) -> list:
    import importlib
    rows, seen = [], set()
    for name, arguments, options, home in launches:
        key = (name, json.dumps(arguments, sort_keys=True, default=str), json.dumps(options, sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        kernel = getattr(importlib.import_module(home), name)       # the module's own, or gdngen.runtime's
        values = {n: _argument(d) for n, d in arguments.items()}
        compiled, report, sass = compile_report(kernel, values, options)
        constexprs = {n: d[1] for n, d in arguments.items()
                      if d[0] == "value" and n in [kernel.arg_names[i] for i in kernel.constexprs]}
        if ptx_dir:
            os.makedirs(ptx_dir, exist_ok=True)
            tag = f"{name}_{len(rows)}"
            open(os.path.join(ptx_dir, tag + ".ptx"), "w").write(compiled.asm["ptx"])
            open(os.path.join(ptx_dir, tag + ".sass"), "w").write(sass)
        rows.append(dict(kernel=name, constexprs=constexprs, options=options, registers=report["regs"],
                         stack=report["stack"], spill_stores=report["spill_stores"],
                         spill_loads=report["spill_loads"], shared=compiled.metadata.shared,
                         serialized=report["serialized"], partitions=_partitions(sass)))
    return rows


def _print(rows: list) -> None:
    for row in rows:
        flags = {k: v for k, v in row["constexprs"].items() if isinstance(v, bool) and v}
        print(f"{row['kernel']} {' '.join(flags)} {row['options']}")
        print(f"  registers {row['registers']}, stack {row['stack']} B, spills {row['spill_stores']} / "
              f"{row['spill_loads']} B, shared {row['shared']} B"
              + (f", WGMMA SERIALIZED ({'; '.join(row['serialized'])})" if row["serialized"] else ""))
        for part in row["partitions"]:
            print(f"    {part['regs']:>15}: {part['n']:5d} instr, STL {part['STL']:3d}, LDL {part['LDL']:3d} "
                  f"({part['loop_STL']} / {part['loop_LDL']} in loops), wgmma {part['wgmma']:3d} "
                  f"({part['serial']} waited at once)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="gated_delta_rule")
    parser.add_argument("--shape", default="1,256,2,4", help="B,T,H,HV (small: the kernels do not depend on T)")
    parser.add_argument("--kv", default="128,128", help="K,V")
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    parser.add_argument("--switches", default="", help="override switches: name=1,name=0 (state_pieces=4: pieces and their walks)")
    parser.add_argument("--final-state", action="store_true", help="the call asks for the final state (a kernel "
                        "that also stores it compiles apart; a training step without it has no final-state gradient)")
    parser.add_argument("--no-initial-state", action="store_true", help="the call passes no initial state (as the "
                        "benchmarks' calls)")
    parser.add_argument("--triton", help="a folder holding the H200's Triton (put first on the path to compile)")
    parser.add_argument("--kernel", default="", help="only the kernels whose names contain this")
    parser.add_argument("--set", default="", help="constexprs / launch options to replace, e.g. "
                        "VALUES_REGS=152,SCORES_REGS=176 (a register split) or maxnreg=128")
    parser.add_argument("--ptx-dir", help="keep each kernel's PTX and SASS here")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--calls", action="store_true", help="every call users make (forward / training, dense / "
                        "pieces, final state or not), each compiled as made: local loads in loops per partition")
    parser.add_argument("--_record", help=argparse.SUPPRESS)
    parser.add_argument("--_compile", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._record:
        switches = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.switches.split(",") if kv}
        launches = record(args.module, tuple(int(x) for x in args.shape.split(",")),
                          tuple(int(x) for x in args.kv.split(",")), args.mode, switches, args.final_state,
                          not args.no_initial_state)
        pickle.dump(launches, open(args._record, "wb"))
        return
    if args._compile:
        settings = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.set.split(",") if kv}
        rows = compile_all(_adjusted(pickle.load(open(args._compile, "rb")), args.kernel, settings), args.ptx_dir)
        json.dump(rows, sys.stdout)
        return
    if args.calls:
        _sweep_calls(args)
        return
    rows = _record_and_compile(args, args.mode, args.switches, args.final_state, not args.no_initial_state)
    _print(rows)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


def _record_and_compile(args, mode: str, switches: str, final_state: bool, initial_state: bool) -> list:
    """Phase 1 under the interpreter, phase 2 with the H200's Triton, each in a process of its own: the rows."""
    with tempfile.TemporaryDirectory() as tmp:
        launches = os.path.join(tmp, "launches.pkl")
        common = ["--module", args.module, "--shape", args.shape, "--kv", args.kv, "--mode", mode, "--switches",
                  switches] + (["--final-state"] if final_state else []) + ([] if initial_state else ["--no-initial-state"])
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
        subprocess.run([sys.executable, __file__, *common, "--_record", launches], env=env, check=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.triton, ROOT) if p)
        extra = ["--kernel", args.kernel, "--set", args.set] + (["--ptx-dir", args.ptx_dir] if args.ptx_dir else [])
        out = subprocess.run([sys.executable, __file__, *common, "--_compile", launches, *extra], env=env,
                             check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


def _sweep_calls(args) -> None:
    """``--calls``: every call users make of the selected kernels (``--kernel``), each compiled as that call makes
    it: a no-grad forward and a training step, dense and in pieces (state_pieces=4), with the final state asked
    and without, no initial state (``--switches`` added to each). Why: ptxas allocates each constexpr variant's
    registers on its own, and a variant nobody timed can spill in its loop (stop 62: the pass over pieces without
    the final state, 12-16% slower). One line per call and kernel: its partitions' local loads inside loops, then in all."""
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        for pieces in (1, 4):
            for final_state in (False, True):
                call = f"{mode} {'pieces' if pieces > 1 else 'dense'} {'final' if final_state else 'no final'}"
                print(f"{call} ...", file=sys.stderr, flush=True)
                switches = ",".join(kv for kv in (args.switches, f"state_pieces={pieces}") if kv)
                for row in _record_and_compile(args, mode, switches, final_state, False):
                    rows.append(dict(row, call=call))
    for row in rows:
        loads = " | ".join(f"{p['loop_LDL']}/{p['LDL']}" for p in row["partitions"])
        print(f"{row['call']:<24} {row['kernel']:<28} spills {row['spill_stores']:>4} B   LDL in loops / all, by "
              f"partition: {loads}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
