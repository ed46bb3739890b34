"""Compile every kernel a generated module launches for sm_90 (Hopper), without a GPU.

Kernels that fail only at GPU compile time (shared memory past Hopper's 227 KiB: Triton's
``OutOfResources``) or that spill registers cost whole GPU runs to discover. Triton compiles for
``GPUTarget("cuda", 90, 32)`` on any machine, so this module finds them on the CPU:

1. **Capture.** The generated module's public functions (``chunk_<name>`` forward + backward and
   ``fused_recurrent_<name>``) run on CPU tensors of a representative shape while
   ``JITFunction.run`` is replaced by a recorder: every ``kernel[grid](...)`` launch is recorded
   with its arguments, constexprs, ``num_warps`` and ``num_stages`` and not executed. The launch
   parameters are therefore exactly those the runtime picks (``gdngen.runtime.tiles``,
   ``backward_tiles``; the recurrent launcher is given the H200's SM count), and the kernels are
   whichever the module's launch code reaches - nothing is listed per spec.
2. **Compile.** Each distinct launch is compiled with ``triton.compile`` for sm_90, with the
   signature and the divisibility attributes Triton's own launcher would derive from the arguments
   (``native_specialize_impl``). Shared memory comes from the compiled metadata; registers and
   spill bytes from ``ptxas -v -arch=sm_90a`` on the PTX (Triton's bundled ptxas).

``check(...)`` returns one row per (shape, kernel launch); rows with ``shared > SHARED_LIMIT`` or
a compile error fail, rows with spills warn. ``gdngen check --compile-sm90`` prints the table.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional

import torch

SHARED_LIMIT = 232448          # bytes of shared memory one block may use on Hopper (227 KiB)
SM_COUNT = 132                 # H200: the recurrent launcher sizes its V tiles by it
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = ((128, 128), (256, 256), (20, 100), (64, 32))
CHUNK_SIZES = (16, 32, 64)
# (N, H, HV): one sequence of few heads (narrow tiles: the state passes split V over more programs)
# and many sequences x heads (the widest tiles)
PARALLELISM = ((1, 1, 2), (2, 16, 32))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One representative launch shape: head dims, chunk size, input dtype, sequences x heads."""
    K: int
    V: int
    BT: int
    dtype: str
    N: int
    H: int
    HV: int

    @property
    def label(self) -> str:
        return f"K={self.K} V={self.V} BT={self.BT} {self.dtype} N={self.N} HV={self.HV}"


def shapes(dtypes: Iterable[str] = DTYPES, head_dims=HEAD_DIMS, chunk_sizes=CHUNK_SIZES,
           parallelism=PARALLELISM) -> list[Shape]:
    """The cross product of the representative choices."""
    return [Shape(K, V, BT, dt, N, H, HV) for dt in dtypes for (K, V) in head_dims for BT in chunk_sizes
            for (N, H, HV) in parallelism]


# ---- capture -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](...)`` call."""
    fn: object                 # the JITFunction
    args: dict                 # parameter name -> value (tensors, ints, floats, constexpr values)
    num_warps: int
    num_stages: int


def _bind(fn, args, kwargs) -> dict:
    """Parameter name -> value, defaults filled in (the way the launcher binds them)."""
    import inspect
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in fn.arg_names})
    bound.apply_defaults()
    return dict(bound.arguments)


@contextlib.contextmanager
def _recording(module):
    """Record launches instead of running them; CPU tensors pass the module's backend check."""
    from triton.runtime.jit import JITFunction
    from gdngen.runtime import recurrent as recurrent_mod

    launches: list[Launch] = []
    original_run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, _bind(self, args, kwargs), int(kwargs.get("num_warps", 4)),
                               int(kwargs.get("num_stages", 3))))
        return None

    def gpu_recurrent_tiles(spec_name, *, N, HV, K, V, state_dtype, device):
        # what recurrent_tiles picks on an H200 (its CPU branch is the interpreter's choice)
        config = recurrent_mod.default_recurrent_tiles(N=N, HV=HV, K=K, V=V, state_dtype=state_dtype, sms=SM_COUNT)
        chosen = recurrent_mod._OVERRIDES.get((spec_name, recurrent_mod.STAGE))
        return {**config, **chosen, "BK": config["BK"]} if chosen else config

    patched = {}
    for name, value in (("check_backend", lambda x: None), ("recurrent_tiles", gpu_recurrent_tiles)):
        if hasattr(module, name):
            patched[name] = getattr(module, name)
            setattr(module, name, value)
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original_run
        for name, value in patched.items():
            setattr(module, name, value)


def _inputs(spec, shape: Shape, T: int, *, grads: bool) -> dict:
    """Inputs for the spec's chunk/recurrent functions at ``shape`` (every in-kernel option on)."""
    from gdngen.selfcheck import make_inputs
    fused_gate = "fused" in spec.gates.decay
    inputs = make_inputs(spec, B=shape.N, T=T, H=shape.H, HV=shape.HV, K=shape.K, V=shape.V,
                         dtype=DTYPES[shape.dtype], h0=True, fused_gate=fused_gate)
    if grads:
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.requires_grad_(True)
    return inputs


def _options(function, spec) -> list[dict]:
    """Keyword sets that reach every kernel: all in-kernel options on, one call per feature map kind."""
    import inspect
    params = inspect.signature(function).parameters
    base = {"output_final_state": True}
    for flag in ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel"):
        if flag in params:
            base[flag] = True
    variants = [base]
    if "feature_map" in params:
        maps = [m for m in spec.feature_maps if m != "identity"]
        variants = [dict(base, feature_map=m) for m in maps if m != "random_features"][:1] or [base]
        if "random_features" in maps:
            variants.append(dict(base, feature_map="random_features"))
    return variants


def capture(spec, module, shape: Shape) -> list[tuple[str, Launch]]:
    """Every launch of the module's chunk forward + backward and recurrent decode at ``shape``.

    Returns (phase, launch) pairs, phase one of ``fwd``, ``bwd``, ``recurrent``.
    """
    import inspect
    found: list[tuple[str, Launch]] = []
    chunk = getattr(module, spec.chunk_function)
    T = 2 * shape.BT                   # two chunks: the state passes run their loop
    for options in _options(chunk, spec):
        inputs = _inputs(spec, shape, T, grads=True)
        params = inspect.signature(chunk).parameters
        extra = {}
        if "use_gate_in_kernel" in params and "A_log" in inputs:
            extra["use_gate_in_kernel"] = True
        if options.get("feature_map") == "random_features":
            extra["feature_projection"] = torch.randn(shape.K, shape.K)
        with _recording(module) as launches:
            o, final_state = chunk(**inputs, **options, **extra, chunk_size=shape.BT)
        found += [("fwd", x) for x in launches]
        leaves = [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
        if o.requires_grad:
            outs = [o] + ([final_state] if final_state is not None else [])
            with _recording(module) as launches:
                torch.autograd.grad(outs, leaves, [torch.ones_like(x) for x in outs], allow_unused=True)
            found += [("bwd", x) for x in launches]
    recurrent = getattr(module, spec.recurrent_function, None)
    if recurrent is not None:
        for options in _options(recurrent, spec):
            inputs = _inputs(spec, shape, 1, grads=False)
            params = inspect.signature(recurrent).parameters
            if "use_gate_in_kernel" in params and "A_log" in inputs:
                options = dict(options, use_gate_in_kernel=True)
            if options.get("feature_map") == "random_features":
                options = dict(options, feature_projection=torch.randn(shape.K, shape.K))
            inputs = {k: v for k, v in inputs.items() if k in params}
            with _recording(module) as launches:
                recurrent(**inputs, **options)
            found += [("recurrent", x) for x in launches]
    return found


# ---- compile -------------------------------------------------------------------------------------

def _target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


def ptxas_path() -> Optional[str]:
    """Triton's bundled ptxas (None when this Triton has no NVIDIA backend)."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return str(path) if path.exists() else None


def unavailable_reason() -> Optional[str]:
    """Why sm_90 compilation cannot run here, or None when it can."""
    try:
        from triton.compiler.compiler import make_backend
        make_backend(_target())
    except Exception as exc:      # no NVIDIA backend in this Triton build
        return f"Triton has no NVIDIA backend ({exc})"
    if ptxas_path() is None:
        return "Triton's bundled ptxas is missing"
    return None


def _signature(launch: Launch):
    """Triton's own specialization of the recorded arguments: signature, constexprs, attrs."""
    from triton._C.libtriton import native_specialize_impl
    from triton.compiler.compiler import make_backend
    backend = make_backend(_target())
    fn = launch.fn
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        # a parameter the launch left to its default (a constexpr with one) takes it, as a launch would
        if param.name in launch.args:
            value = launch.args[param.name]
        elif param.has_default:
            value = param.default
        else:
            raise KeyError(f"{fn.__name__}: the recorded launch has no {param.name!r} and it has no default")
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(type(backend), value, param.is_const, not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)[:2]
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = value
        elif isinstance(key, str):
            parsed = backend.parse_attr(key)
            if parsed:
                attrs[(index,)] = parsed
    return signature, constexprs, attrs


def _key(launch: Launch) -> tuple:
    """Launches with equal keys compile to the same binary. Kernels of different specs share names
    and often signatures (simple_gla's and gated_delta_rule's _output_fwd_kernel) but not their
    bodies: the JIT function's cache_key (a hash of its source and dependencies) tells them apart."""
    signature, constexprs, attrs = _signature(launch)
    return (launch.fn.__name__, launch.fn.cache_key, tuple(sorted(signature.items())), tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
            tuple(sorted((k, repr(v)) for k, v in attrs.items())), launch.num_warps, launch.num_stages)


def compile_sm90(launch: Launch, **options):
    """``triton.compile`` of one launch for sm_90, its arguments specialised as Triton's launcher would; a Gluon
    kernel from its Gluon source (benchmarks/offline_sm90.py); ``options`` beyond num_warps / num_stages (maxnreg)
    passed on."""
    import triton
    from triton.compiler import ASTSource
    source = ASTSource
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
        if isinstance(launch.fn, GluonJITFunction):
            source = GluonASTSource
    except ImportError:            # a Triton without Gluon
        pass
    signature, constexprs, attrs = _signature(launch)
    return triton.compile(source(launch.fn, signature, constexprs, attrs), target=_target(),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **options))


def compile_launch(launch: Launch) -> dict:
    """Compile one launch for sm_90: shared bytes, registers, spill bytes (or the error)."""
    result = {"shared": None, "regs": None, "spill": None, "serialized": [], "error": None}
    try:
        compiled = compile_sm90(launch)
    except Exception as exc:       # OutOfResources, MLIR/PTX failures: the row fails with the message
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        return result
    result["shared"] = int(compiled.metadata.shared)
    report = ptxas_report(compiled.asm["ptx"])
    result["regs"] = report["regs"]
    result["spill"] = report["spill_stores"] + report["spill_loads"]
    result["serialized"] = report["serialized"]
    return result


def ptxas_report(ptx: str, *, maxnreg: Optional[int] = None, cubin: Optional[str] = None) -> dict:
    """``ptxas -v -arch=sm_90a`` on ``ptx``: registers (None if it failed), spill bytes (stores, loads), stack
    bytes, and why ptxas serialised the wgmmas ("C7512": every wgmma then waits for the one before it; empty
    when it did not). ``maxnreg``: the launch's register cap; ``cubin``: where to keep the binary."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(ptx)
    try:
        info = ""
        # Triton 3.9's PTX may need the newer ptxas it bundles next to the CUDA 12 one
        for ptxas in (ptxas_path(), ptxas_path() + "-blackwell"):
            if os.path.exists(ptxas):
                command = [ptxas, "-v", "-arch=sm_90a", handle.name, "-o", cubin or os.devnull]
                if maxnreg:
                    command[1:1] = ["--maxrregcount", str(maxnreg)]
                info = subprocess.run(command, capture_output=True, text=True).stderr
                if "Used" in info:
                    break
    finally:
        os.unlink(handle.name)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", info)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    stacks = [int(x) for x in re.findall(r"(\d+) bytes stack frame", info)]
    return dict(regs=max(regs) if regs else None,
                spill_stores=max((int(a) for a, _ in spills), default=0),
                spill_loads=max((int(b) for _, b in spills), default=0),
                stack=max(stacks, default=0),
                serialized=re.findall(r"wgmma.mma_async instructions are serialized due to (.*?) for", info))


def _launch_config(launch: Launch) -> str:
    parts = [f"{k}={launch.args[k]}" for k in ("BK", "BV", "BH", "BR", "BM") if k in launch.args]
    return " ".join(parts + [f"w={launch.num_warps}", f"s={launch.num_stages}"])


def check(spec_names: Optional[list[str]] = None, shape_list: Optional[list[Shape]] = None,
          progress=None, kernels: Optional[list[str]] = None) -> list[dict]:
    """Rows (spec, shape, phase, kernel, config, shared, regs, spill, error, status) for every launch.

    ``status`` is ``fail`` (compile error or shared memory over :data:`SHARED_LIMIT`), ``warn``
    (register spills, or wgmmas ptxas serialised: ``serialized``) or ``ok``. Identical launches compile once. ``kernels`` keeps only the
    launches whose kernel name contains one of its strings (e.g. ``["_state_"]``).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter replaces @triton.jit kernels by Python ones: compile in a fresh process
        return _check_in_subprocess(spec_names, shape_list, kernels)
    from gdngen.spec import catalogue, load_spec
    specs = [load_spec(p) for p in catalogue()]
    if spec_names:
        specs = [s for s in specs if s.name in spec_names]
        missing = set(spec_names) - {s.name for s in specs}
        if missing:
            raise ValueError(f"spec_names: not in the catalogue: {sorted(missing)}")
    shape_list = shape_list if shape_list is not None else shapes()
    compiled: dict[tuple, dict] = {}
    rows = []
    for spec in specs:
        module = importlib.import_module(f"generated.{spec.name}")
        for shape in shape_list:
            if shape.K > spec.heads.max_k or shape.V > spec.heads.max_v or shape.BT not in spec.chunk.sizes:
                continue
            seen = set()
            for phase, launch in capture(spec, module, shape):
                if kernels and not any(part in launch.fn.__name__ for part in kernels):
                    continue
                key = _key(launch)
                if key in seen:
                    continue
                seen.add(key)
                if key not in compiled:
                    compiled[key] = compile_launch(launch)
                    if progress:
                        progress(f"{spec.name} {shape.label} {launch.fn.__name__}")
                result = compiled[key]
                status = "ok"
                if result["error"] or (result["shared"] or 0) > SHARED_LIMIT:
                    status = "fail"
                elif result["spill"] or result["serialized"]:
                    status = "warn"
                rows.append(dict(spec=spec.name, **dataclasses.asdict(shape), phase=phase,
                                 kernel=launch.fn.__name__, config=_launch_config(launch), **result, status=status))
    return rows


def _check_in_subprocess(spec_names, shape_list, kernels) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    payload = json.dumps({"specs": spec_names, "kernels": kernels, "shapes": [dataclasses.asdict(s) for s in shape_list]
                          if shape_list is not None else None})
    done = subprocess.run([sys.executable, "-m", "gdngen.compilecheck", "--json", payload], env=env,
                          capture_output=True, text=True, cwd=str(Path(__file__).resolve().parent.parent))
    if done.returncode != 0:
        raise RuntimeError(f"compile check subprocess failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows."""
    lines = ["| spec | shape | phase | kernel | launch | shared KiB | regs | spill B | status |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        shape = f"K={r['K']} V={r['V']} BT={r['BT']} {r['dtype']} N={r['N']} HV={r['HV']}"
        shared = "" if r["shared"] is None else f"{r['shared'] / 1024:.1f}"
        status = r["status"] + (f" ({r['error']})" if r["error"] else "")
        if r.get("serialized"):
            status += " (wgmma serialized: " + "; ".join(r["serialized"]) + ")"
        lines.append(f"| {r['spec']} | {shape} | {r['phase']} | {r['kernel']} | {r['config']} | {shared} | "
                     f"{r['regs'] if r['regs'] is not None else ''} | {r['spill'] if r['spill'] is not None else ''} "
                     f"| {status} |")
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--json"]:
        payload = json.loads(argv[1])
        shape_list = [Shape(**s) for s in payload["shapes"]] if payload["shapes"] is not None else None
        print(json.dumps(check(payload["specs"], shape_list, kernels=payload.get("kernels"))))
        return 0
    raise SystemExit("usage: gdngen check --compile-sm90 [SPEC...]")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
