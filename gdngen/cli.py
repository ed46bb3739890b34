"""``gdngen`` command line: build | list | show | check | bench | tune."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from gdngen.spec import SpecError, catalogue, load_spec


def _spec_paths(names: list[str]) -> list[Path]:
    """Accept spec file paths or bare catalogue names; none means the whole catalogue."""
    if not names:
        return catalogue()
    paths = []
    for name in names:
        path = Path(name)
        if not path.exists() and not name.endswith(".yaml"):
            path = Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml"
        paths.append(path)
    return paths


def _progress(i: int, n: int, label: str) -> None:
    """A one-line progress bar on stderr (kept plain: no dependency for it)."""
    width = 24
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:48]:<48}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_build(args) -> int:
    from gdngen.render import build
    for path in _spec_paths(args.specs):
        target, changed = build(path, args.out)
        print(f"{'wrote' if changed else 'unchanged'} {target}")
    return 0


def cmd_list(args) -> int:
    from gdngen.plan import build_plan
    print(f"{'spec':<18} {'decay':<7} {'delta':<6} {'backend':<10} function")
    for path in catalogue():
        spec = load_spec(path)
        plan = build_plan(spec)
        print(f"{spec.name:<18} {spec.transition.decay:<7} {str(spec.transition.delta):<6} "
              f"{plan.backend:<10} {spec.chunk_function}")
    return 0


def cmd_show(args) -> int:
    from gdngen.plan import build_plan
    from gdngen.render import render_module
    spec = load_spec(_spec_paths([args.spec])[0])
    if args.code:
        print(render_module(spec), end="")
        return 0
    plan = build_plan(spec)
    print(f"spec {spec.name} (hash {spec.hash}) backend={plan.backend}")
    for stage in plan.stages:
        print(f"  stage {stage.name:<7} {stage.kernel:<22} {stage.purpose}")
    print(f"backward backend={plan.backward_backend}"
          + (f" ({plan.backward_reason})" if plan.backward_backend != "triton" and plan.backward_reason else ""))
    for stage in plan.backward_stages:
        print(f"  stage {stage.name:<7} {stage.kernel:<22} {stage.purpose}")
    for key, value in plan.exprs.items():
        print(f"  expr {key:<20} {value}")
    return 0


def _ensure_backend() -> str:
    """CUDA when present, else the Triton interpreter on CPU (set before triton is imported)."""
    import torch
    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def _import_generated(spec, out_dir: str | None):
    if out_dir:
        sys.path.insert(0, str(Path(out_dir).resolve().parent))
        return importlib.import_module(f"{Path(out_dir).name}.{spec.name}")
    return importlib.import_module(f"generated.{spec.name}")


def cmd_compile_sm90(args) -> int:
    """Compile every launched kernel for sm_90 (no GPU): shared memory, registers, spills."""
    from gdngen import compilecheck
    reason = compilecheck.unavailable_reason()
    if reason:
        print(f"gdngen check --compile-sm90: {reason}", file=sys.stderr)
        return 2
    names = [load_spec(p).name for p in _spec_paths(args.specs)]
    dtypes = args.dtypes.split(",") if args.dtypes else list(compilecheck.DTYPES)
    chunks = [int(x) for x in args.chunk_sizes.split(",")] if args.chunk_sizes else list(compilecheck.CHUNK_SIZES)
    rows = compilecheck.check(names, compilecheck.shapes(dtypes, chunk_sizes=chunks),
                              progress=lambda label: sys.stderr.write(f"compiled {label}\n"))
    print(compilecheck.format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    fails = [r for r in rows if r["status"] == "fail"]
    warns = [r for r in rows if r["status"] == "warn"]
    print(f"compile check (sm_90, shared limit {compilecheck.SHARED_LIMIT} B): {len(rows)} launches, "
          f"{len(fails)} fail, {len(warns)} spill")
    return 1 if fails else 0


def cmd_check(args) -> int:
    if args.compile_sm90:
        return cmd_compile_sm90(args)
    from gdngen.render import is_stale
    paths = _spec_paths(args.specs)
    stale = [p for p in paths if is_stale(p, args.out)]
    for p in stale:
        print(f"stale: generated module for {p} differs from a fresh render (run: gdngen build {p})")
    if args.stale:
        if not stale:
            print(f"generated/ is up to date with specs/ and templates/ ({len(paths)} specs)")
        return 1 if stale else 0
    if stale:
        return 1
    device = _ensure_backend()
    from gdngen.selfcheck import self_check
    failures = 0
    for i, path in enumerate(paths):
        spec = load_spec(path)
        module = _import_generated(spec, args.out)
        for row in self_check(spec, module, device):
            status = "ok  " if row["ok"] else "FAIL"
            failures += not row["ok"]
            print(f"{status} {spec.name:<18} {row['case']:<44} rel_rmse o={row['o']:.2e} ht={row['ht']:.2e} "
                  f"(tol {row['tol']:.0e})")
    print(f"self-check on {device}: {'all passed' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


def cmd_bench(args) -> int:
    """Side-by-side benchmark (gdngen.bench): rows to a JSON file as measured, a table, a PNG."""
    from gdngen import bench
    if args.plot:
        rows = json.loads(Path(args.plot).read_text())
        target = Path(args.png) if args.png else Path(args.plot).with_suffix(".png")
        try:
            bench.write_plot(rows, target, title=Path(args.plot).stem)
        except ValueError as exc:
            print(f"gdngen bench: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {target}")
        return 0
    device = _ensure_backend()
    import torch
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    try:
        plan = bench.parse_cases(args.cases, device)
        modes = bench.parse_list(args.modes, bench.MODES, "--modes")
        names = bench.parse_list(args.impls, bench.ALL_IMPLS, "--impls")
        dtype = dtypes[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    except (ValueError, KeyError) as exc:
        msg = exc if isinstance(exc, ValueError) else f"--dtype: expected one of {sorted(dtypes)}, got {args.dtype!r}"
        print(f"gdngen bench: {msg}", file=sys.stderr)
        return 2
    plan = [(case, tuple(m for m in case_modes if m in modes)) for case, case_modes in plan]
    plan = [(case, case_modes) for case, case_modes in plan if case_modes]
    budget = bench.Budget(args.time_budget)
    spec = load_spec(_spec_paths([args.spec])[0])
    module = _import_generated(spec, args.generated)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if not args.skip_check:
        from gdngen.selfcheck import self_check
        failed = [row for row in self_check(spec, module, device) if not row["ok"]]
        for row in failed:
            print(f"FAIL {spec.name} {row['case']}: rel_rmse o={row['o']:.2e} ht={row['ht']:.2e} (tol {row['tol']:.0e})",
                  file=sys.stderr)
        if failed:
            print("gdngen bench: the self-check against the float64 reference failed; not timing wrong code "
                  "(--skip-check to time anyway)", file=sys.stderr)
            return 1
        print(f"self-check of {spec.chunk_function} against the float64 reference on {device}: ok", file=sys.stderr)
    impls = bench.load_impls(names, spec, module, device, log=lambda msg: print(msg, file=sys.stderr))
    if not impls:
        print("gdngen bench: no implementation available", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else bench.default_out_path(device_name, Path(__file__).resolve().parent.parent)
    rows = bench.RowFile(out, append=args.append)
    with bench.ClockLog(bench.gpu_id() if device == "cuda" else None) as clocks:
        summary = bench.run_bench(spec, plan, impls, rows, device=device, dtype=dtype, budget=budget,
                                  device_name=device_name, clocks=clocks)
    if device == "cpu":
        print("(CPU, Triton interpreter: the timings only show that the code runs)")
    print(bench.format_table(rows.rows))
    if summary["skipped"]:
        print(f"time budget of {args.time_budget:g} s reached after {budget.elapsed():.0f} s: "
              f"skipped {len(summary['skipped'])} rows: {', '.join(summary['skipped'])}")
    print(f"wrote {out} ({len(rows.rows)} rows)")
    if any(r.get("ms") for r in rows.rows):
        print(f"wrote {bench.write_plot(rows.rows, out.with_suffix('.png'), title=out.stem)}")
    return 0


def cmd_tune(args) -> int:
    """Tune launch configs per shape class on this GPU and write them to the per-device cache."""
    import torch
    if not torch.cuda.is_available() and not args.interpret:
        print("gdngen tune: tuning measures kernels on a CUDA GPU and none is available here.\n"
              "  Run it on the GPU the cache is for (e.g. the H200); --interpret runs a smoke test of the "
              "tuner under the Triton interpreter (tiny shapes, wall-clock timing: the numbers mean nothing).",
              file=sys.stderr)
        return 2
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    from gdngen.autotune.tuner import (ShapeCase, format_recurrent_rows, format_report, format_split_rows, tune,
                                       tune_recurrent, tune_split)
    dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
              "fp32": torch.float32, "float32": torch.float32}
    dtype = dtypes.get(args.dtype or ("fp32" if args.interpret else "bf16"))
    if dtype is None:
        print(f"gdngen tune: --dtype: expected one of {sorted(dtypes)}, got {args.dtype!r}", file=sys.stderr)
        return 2
    spec = load_spec(_spec_paths([args.spec])[0])
    module = _import_generated(spec, args.out)
    if args.shapes:
        texts = args.shapes
    elif args.interpret:
        texts = ["1,40,1,2,16,16"]
    else:
        texts = ["4,8192,16,32,128,128", "1,32768,32,32,128,128", "8,2048,16,16,128,128", "1,32768,2,8,128,128"]
    try:
        shapes = [ShapeCase.parse(t, dtype) for t in texts]
        stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
        if args.backward:
            stages = (stages or ["fwd"]) + ["bwd"]
        chunks = [int(c) for c in args.chunk_sizes.split(",")] if args.chunk_sizes else None
        if args.interpret:
            chunks = chunks or [spec.chunk.default if spec.chunk.default in spec.chunk.sizes else spec.chunk.sizes[0]]
        limit = args.max_candidates if args.max_candidates is not None else (3 if args.interpret else 24)
        limit = limit or None           # 0: the whole pruned space
        if args.interpret:
            print("gdngen tune --interpret: smoke test under the Triton interpreter; timings are wall-clock "
                  "on CPU and say nothing about a GPU.", file=sys.stderr)
        split = bool(stages) and "split" in stages
        decode = bool(stages) and "recurrent" in stages
        stages = [s for s in stages if s not in ("split", "recurrent")] if stages else stages
        report = None
        if stages or not (split or decode):
            report = tune(spec, shapes, module=module, stages=stages, chunk_sizes=chunks, cache_dir=args.cache_dir,
                          max_candidates=limit, progress=True, write=not args.dry_run)
        split_rows = []
        if split:
            for chunk in chunks or [spec.chunk.default]:
                split_rows += tune_split(spec, shapes, module=module, chunk_size=chunk, cache_dir=args.cache_dir,
                                         progress=True, write=not args.dry_run)
        recurrent_rows = []
        if decode:
            decode_shapes = shapes if args.shapes or args.interpret else [
                ShapeCase.parse(t, dtype) for t in ("1,1,16,32,128,128", "64,1,16,32,128,128", "256,1,16,32,128,128")]
            recurrent_rows = tune_recurrent(spec, decode_shapes, module=module, cache_dir=args.cache_dir,
                                            max_candidates=args.max_candidates or None, progress=True,
                                            write=not args.dry_run)
    except ValueError as exc:
        print(f"gdngen tune: {exc}", file=sys.stderr)
        return 2
    if recurrent_rows:
        print(format_recurrent_rows(recurrent_rows))
    if report is not None:
        print(format_report(report))
        if report.cache_path:
            print(f"wrote {report.cache_path}")
    if split_rows:
        print(format_split_rows(split_rows))
        if not args.dry_run:
            print("split winners written to the cache (read by gdngen.parallel.split_sequence_forward)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gdngen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="render specs into generated/ (all bundled specs when none given)")
    p.add_argument("specs", nargs="*")
    p.add_argument("--out", default=None, help="output folder (default: the repo's generated/)")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("list", help="the bundled catalogue")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("show", help="a spec's stage plan and printed expressions (or --code)")
    p.add_argument("spec")
    p.add_argument("--code", action="store_true", help="print the rendered module")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("check", help="generated/ up to date, then a self-check against the float64 reference")
    p.add_argument("specs", nargs="*")
    p.add_argument("--stale", action="store_true", help="only check that generated/ matches a fresh render")
    p.add_argument("--out", default=None)
    p.add_argument("--compile-sm90", action="store_true",
                   help="instead: compile every launched kernel for sm_90 without a GPU (gdngen.compilecheck); "
                        "fails on shared memory past Hopper's limit, reports registers and spills")
    p.add_argument("--dtypes", default=None, help="with --compile-sm90: comma-separated subset of bf16,fp16,fp32")
    p.add_argument("--chunk-sizes", default=None, help="with --compile-sm90: comma-separated subset of 16,32,64")
    p.add_argument("--json", default=None, help="with --compile-sm90: also write the rows to this JSON file")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="gdngen vs FLA, FlashQLA and SDPA: rows to JSON, a table and a PNG")
    p.add_argument("spec", nargs="?", default="gated_delta_rule")
    p.add_argument("--cases", default=None, help="issue (default on a GPU: the issue #10 cases), sweep (T 2k..128k), "
                   "names, or B,T,H,HV[,K,V] tuples separated by spaces or ';'")
    p.add_argument("--impls", default=None, help="comma-separated subset of gdngen,fla,flashqla,sdpa (default all "
                   "that import); fla is FLA's op of the spec's name, flashqla and sdpa are gated_delta_rule only")
    p.add_argument("--modes", default=None, help="comma-separated subset of fwd,fwd+bwd (default both)")
    p.add_argument("--dtype", default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop cleanly, skipping the remaining rows, when the next row would not fit")
    p.add_argument("--skip-check", action="store_true", help="skip the self-check against the float64 reference")
    p.add_argument("--out", default=None, help="rows file (default benchmarks/results/<device>_<date>.json); "
                   "the PNG goes next to it")
    p.add_argument("--append", action="store_true", help="add to the rows already in --out")
    p.add_argument("--plot", default=None, metavar="ROWS.json", help="only (re)draw the PNG from a rows file")
    p.add_argument("--png", default=None, help="PNG path for --plot (default: the rows file with .png)")
    p.add_argument("--generated", default=None, help="folder of generated modules (default the repo's generated/)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("tune", help="autotune launch configs on this GPU into the per-device cache")
    p.add_argument("spec")
    p.add_argument("--shapes", nargs="+", metavar="B,T,H,HV,K,V", help="shapes to tune (one per shape class)")
    p.add_argument("--stages", default=None,
                   help="comma-separated stages to tune (default fwd): forward wy,state,output,state_output (the state pass "
                        "of a no-grad forward, which writes the output); backward "
                        "wy_prep_bwd,intra_bwd,state_bwd,chunk_bwd,wy_bwd,wy_decay_bwd (timed as a forward + "
                        "backward step, every gradient checked first); or the groups fwd, bwd, all. "
                        "Stages the spec does not launch are skipped. split: the intra-card sequence split's "
                        "segment count (gdngen.parallel.split_sequence_forward), outputs checked first. "
                        "recurrent: fused_recurrent_* (decode) V tile and warps, float32 state; its shapes "
                        "are B,T,H,HV,K,V with T tokens per call (default B = 1, 64, 256 at T = 1)")
    p.add_argument("--backward", action="store_true",
                   help="also tune every backward stage (the same as adding bwd to --stages)")
    p.add_argument("--chunk-sizes", default=None, help="comma-separated subset of the spec's chunk sizes")
    p.add_argument("--dtype", default=None, help="input dtype: bf16 (GPU default), fp16, fp32")
    p.add_argument("--max-candidates", type=int, default=None, help="candidates per stage nearest the default, default included "
                   "(default 24; 3 with --interpret; 0 = the whole pruned space, ~400 per chunk size at K=V=128)")
    p.add_argument("--cache-dir", default=None, help="cache folder (default $GDNGEN_CACHE_DIR or ~/.cache/gdngen)")
    p.add_argument("--dry-run", action="store_true", help="print the table, write no cache")
    p.add_argument("--interpret", action="store_true",
                   help="without a GPU: smoke-test the tuner under the Triton interpreter (timings meaningless)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_tune)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as exc:
        print(f"gdngen: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
