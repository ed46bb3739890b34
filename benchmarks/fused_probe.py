"""Forward variants of gated_delta_rule side by side (CUDA only; an experiment, stop 27).

    python benchmarks/fused_probe.py [--cases "1,32768,32,32"] [--out rows.jsonl]

* ``default fwd``: the forward as shipped (no_grad, so the output is fused into the state pass where
  ``tiles.fused_output`` allows it); ``fused_output=True/False``: forced either way.
* ``fused state_output BV=.. w=.. s=..``: fused, with those tiles for the pass.

Stop 27's first run (benchmarks/results/2026-12-01-h200-stop27-call1-probe.jsonl) priced the wy stage's
scores before they existed: a copy of the module whose fused output loaded the wy stage's T as a
stand-in [BT, BT] tile (rows ``fused+aqk-standin``; wrong outputs, times only).
* ``--fused-tiles "32,4,2,tma"``: a fourth field ``tma`` loads the pass's tiles through TMA descriptors
  (stop 28); such rows also give ``max_abs_vs_pointer_loads``, against the same tiles without TMA.
* ``--train-state-tiles "32,4,2,tma"``: forward + backward with those tiles for the training forward's
  (unfused) state pass.
* ``--bwd-tiles "wy:TMA=1 chunk:BK=128,num_warps=8"``: forward + backward with one backward stage's
  launch parameters overridden (``override_backward``); each row also gives ``max_abs_grad_vs_default``,
  the largest difference of any gradient against the default tiles' (0: bitwise the same).
* ``--keep-values``: forward + backward with the forward's V_new kept for the backward (the default since
  stop 29) and recomputed by wy_prep (``override(spec, "keep_values", value=False)``), timed in the order
  kept, recomputed, recomputed, kept: ms, peak MiB, and the largest gradient difference between the two.
* ``--intermediates "split float16"`` (``--split``: split alone): each ``dtypes.intermediates`` policy built into a
  temp folder; forward and forward+backward (the base timed before and after),
  and the relative error of o against float64 at T=4096 beside the base's.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402
import yaml  # noqa: E402


def load_module(path: Path, name: str):
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def policy_module(folder: Path, policy: str):
    """gated_delta_rule with ``dtypes.intermediates: <policy>``, built into ``folder`` and imported."""
    from gdngen.cli import main
    d = yaml.safe_load((ROOT / "specs" / "gated_delta_rule.yaml").read_text())
    name = d["name"] = f"gated_delta_rule_{policy}"
    d.setdefault("dtypes", {})["intermediates"] = policy
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    assert main(["build", str(path), "--out", str(folder / "gen")]) == 0
    return load_module(folder / "gen" / f"{name}.py", name)


def inputs(B, T, H, HV, K=128, V=128, seed=0, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)
    x = dict(q=randn(B, T, H, K).bfloat16(), k=torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).bfloat16(),
             v=randn(B, T, HV, V).bfloat16(), g=torch.nn.functional.logsigmoid(randn(B, T, HV) + 2.0),
             beta=torch.sigmoid(randn(B, T, HV)))
    if grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


def row_recorder(name: str):
    """``record(**row)``: the row, stamped with the host clock (a clock log sampled beside it lines up), printed as
    JSON and appended to ``$OUT/<name>`` (or ``./<name>``) at once, so a call cut at its time limit keeps the rows
    so far."""
    out = open(os.path.join(os.environ.get("OUT", "."), name), "a")

    def record(**row):
        row["host_time"] = round(time.time(), 3)
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()
    return record


def no_grad_forward_cases(op, cases: str):
    """For each "B,T,H,HV" of the space-separated ``cases``: (B, T, H, HV) and a function running ``op``'s
    no-grad forward (with the final state) on that case's :func:`inputs`."""
    for text in cases.split():
        B, T, H, HV = (int(x) for x in text.split(","))
        x = inputs(B, T, H, HV)

        def fwd(x=x):
            with torch.no_grad():
                return op(**x, output_final_state=True)
        yield (B, T, H, HV), fwd


def row_writer(path):
    """A function that prints a row as JSON and appends it to ``path`` (when given) as soon as it is measured
    (a device run cut at its limit still returns the file)."""
    out = open(path, "a") if path else None

    def record(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    return record


def parse_tile(text):
    """"BV,warps,stages[,tma]" -> (BV, warps, stages, tma)."""
    fields = text.split(",")
    return int(fields[0]), int(fields[1]), int(fields[2]), len(fields) > 3 and fields[3] == "tma"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1,32768,32,32")
    parser.add_argument("--fused-tiles", default="", help='state_output tiles to try at every case, e.g. "32,4,2 64,8,2"')
    parser.add_argument("--wy-tiles", default="", help='wy tiles for the fused forward, e.g. "64,4,2 128,2,1" (BK,warps,stages)')
    parser.add_argument("--train-state-tiles", default="", help='state tiles for forward+backward, e.g. "32,4,2 32,4,2,tma"')
    parser.add_argument("--bwd-tiles", default="", help='backward overrides, e.g. "wy:TMA=1 wy:BK=128,num_warps=8,TMA=1"')
    parser.add_argument("--keep-values", action="store_true")
    parser.add_argument("--split", action="store_true", help="the same as --intermediates split")
    parser.add_argument("--intermediates", default="", help='dtypes.intermediates policies beside the base, e.g. "split float16"')
    parser.add_argument("--rounds", type=int, default=1, help="with --intermediates: fwd+bwd timed this many times over, interleaved")
    parser.add_argument("--no-precision", action="store_true", help="with --intermediates: skip the precision rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from gdngen.runtime import override
    base = importlib.import_module("generated.gated_delta_rule")
    folder = Path(tempfile.mkdtemp())
    policies = args.intermediates.split() + (["split"] if args.split and "split" not in args.intermediates.split() else [])
    variants = {policy: policy_module(folder, policy) for policy in policies}
    record = row_writer(args.out)

    def op(module):
        return getattr(module, "chunk_" + module.SPEC.name)

    def time_fwd(module, x, **kw):
        fn = op(module)
        with torch.no_grad():
            def run():
                return fn(**x, **kw)
            run()
            torch.cuda.synchronize()
            return triton.testing.do_bench(run, warmup=100, rep=400, return_mode="median")

    def time_train(module, x):
        fn = op(module)
        do = torch.randn_like(x["v"])

        def run():
            o, _ = fn(**x)
            torch.autograd.grad(o, [x[n] for n in ("q", "k", "v", "g", "beta")], do)
        run()
        torch.cuda.synchronize()
        return triton.testing.do_bench(run, warmup=100, rep=400, return_mode="median")

    def guarded(fn, *a):
        try:
            return fn(*a)
        except Exception as exc:  # a tile that does not compile or fit is a row too
            return f"failed: {type(exc).__name__}: {str(exc)[:200]}"

    for text in args.cases.split():
        B, T, H, HV = (int(n) for n in text.split(","))
        x = inputs(B, T, H, HV)
        case = dict(B=B, T=T, H=H, HV=HV)
        record(dict(case, variant="default fwd", ms=time_fwd(base, x)))
        for fused in (False, True):
            with override("gated_delta_rule", "fused_output", value=fused):
                record(dict(case, variant=f"fused_output={fused} fwd", ms=time_fwd(base, x)))
        for tile in args.fused_tiles.split():
            bv, w, st, tma = parse_tile(tile)
            with override("gated_delta_rule", "fused_output", value=True):
                row = dict(case, variant=f"fused state_output BV={bv} w={w} s={st}{' tma' if tma else ''}")
                with override("gated_delta_rule", "state_output", BV=bv, num_warps=w, num_stages=st, TMA=tma):
                    row["ms"] = guarded(time_fwd, base, x)
                    if tma and not isinstance(row["ms"], str):
                        with torch.no_grad():
                            o_tma = op(base)(**x)[0]
                with override("gated_delta_rule", "state_output", BV=bv, num_warps=w, num_stages=st):
                    if tma and not isinstance(row["ms"], str):
                        with torch.no_grad():
                            row["max_abs_vs_pointer_loads"] = (o_tma.float() - op(base)(**x)[0].float()).abs().max().item()
                record(row)
        if args.train_state_tiles:
            xg = inputs(B, T, H, HV, grad=True)
            for tile in args.train_state_tiles.split():
                bv, w, st, tma = parse_tile(tile)
                with override("gated_delta_rule", "state", BV=bv, num_warps=w, num_stages=st, TMA=tma):
                    record(dict(case, variant=f"fwd+bwd, state BV={bv} w={w} s={st}{' tma' if tma else ''}",
                                ms=guarded(time_train, base, xg)))
        if args.bwd_tiles:
            from gdngen.runtime.backward_tiles import override_backward
            xg = inputs(B, T, H, HV, grad=True)
            do = torch.randn_like(xg["v"])
            leaves = [xg[n] for n in ("q", "k", "v", "g", "beta")]
            grads_default = torch.autograd.grad(op(base)(**xg)[0], leaves, do)
            record(dict(case, variant="fwd+bwd, default backward tiles", ms=time_train(base, xg)))
            for item in args.bwd_tiles.split():
                stage, _, fields = item.partition(":")
                config = {key: int(value) for key, value in (f.split("=") for f in fields.split(","))}
                if "TMA" in config:
                    config["TMA"] = bool(config["TMA"])
                row = dict(case, variant=f"fwd+bwd, {stage} backward {config}")
                with override_backward(stage, **config):
                    row["ms"] = guarded(time_train, base, xg)
                    if not isinstance(row["ms"], str):
                        grads = torch.autograd.grad(op(base)(**xg)[0], leaves, do)
                        row["max_abs_grad_vs_default"] = max((a.float() - b.float()).abs().max().item()
                                                             for a, b in zip(grads, grads_default))
                record(row)
        if args.keep_values:
            xg = inputs(B, T, H, HV, grad=True)
            do = torch.randn_like(xg["v"])
            leaves = [xg[n] for n in ("q", "k", "v", "g", "beta")]
            grads = {}
            # both orders: the first fwd+bwd timed at a shape paid for what the process had not yet
            # warmed (stop 30: (8,2048,16,16) read 1.73 ms kept, first, against 1.51 recomputed, second)
            for keep in (True, False, False, True):
                with override("gated_delta_rule", "keep_values", value=keep):
                    grads[keep] = torch.autograd.grad(op(base)(**xg)[0], leaves, do)
                    ms = time_train(base, xg)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    torch.autograd.grad(op(base)(**xg)[0], leaves, do)
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() / 2 ** 20
                record(dict(case, variant=f"fwd+bwd, keep_values={keep}", ms=ms, peak_mib=round(peak, 1)))
            record(dict(case, variant="keep_values: max abs gradient difference",
                        max_abs=max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[True], grads[False]))))
        for tile in args.wy_tiles.split():
            bk, w, st = (int(n) for n in tile.split(","))
            with override("gated_delta_rule", "wy", BK=bk, num_warps=w, num_stages=st):
                record(dict(case, variant=f"fused, wy BK={bk} w={w} s={st}", ms=guarded(time_fwd, base, x)))
        if variants:
            for policy, module in variants.items():
                record(dict(case, variant=f"{policy} fwd", ms=time_fwd(module, x)))
                with override(module.SPEC.name, "fused_output", value=False):
                    record(dict(case, variant=f"{policy} fwd, output stage", ms=time_fwd(module, x)))
            record(dict(case, variant="base fwd (after)", ms=time_fwd(base, x)))
            xg = inputs(B, T, H, HV, grad=True)
            for round_ in range(args.rounds):
                record(dict(case, variant="base fwd+bwd", round=round_, ms=time_train(base, xg)))
                for policy, module in variants.items():
                    record(dict(case, variant=f"{policy} fwd+bwd", round=round_, ms=time_train(module, xg)))
            record(dict(case, variant="base fwd+bwd (after)", ms=time_train(base, xg)))
    if variants and not args.no_precision:
        from gdngen.reference import run as reference_run
        from gdngen.spec import load_spec
        spec = load_spec(str(ROOT / "specs" / "gated_delta_rule.yaml"))
        x = inputs(1, 4096, 16, 32, seed=3)
        ref, _ = reference_run(spec, *(x[n].double().cpu() for n in ("q", "k", "v", "g", "beta")), form="chunked",
                               chunk_size=64)
        with torch.no_grad():
            for label, module in (("base", base), *variants.items()):
                for fused in (True, False):
                    with override(module.SPEC.name, "fused_output", value=fused):
                        o, _ = op(module)(**x)
                    err = ((o.double().cpu() - ref).norm() / ref.norm()).item()
                    record(dict(B=1, T=4096, H=16, HV=32, variant=f"{label} precision, fused={fused}", rel_l2=err))
        # every gradient's rel. RMSE against autograd through the float64 chunked reference
        from gdngen.selfcheck import gradient_errors
        for label, module in (("base", base), *variants.items()):
            errors = gradient_errors(module.SPEC.name, {}, spec=module.SPEC, module=module, device="cuda",
                                     B=1, T=2048, H=4, HV=8, K=128, V=128)
            record(dict(B=1, T=2048, H=4, HV=8, variant=f"{label} gradient precision",
                        **{n: float(f"{e:.4e}") for n, e in errors.items()}))


if __name__ == "__main__":
    main()
