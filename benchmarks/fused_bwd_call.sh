#!/usr/bin/env bash
# The fused backward on one device call (docs/fused_backward.md, sections 11-12; NOTES, stops 65-66):
#   1. the GPU tests of the kernel (every gradient against float64 and the Triton stages);
#   2. the kernel beside the three backward kernels it replaces (override gluon_fused_bwd off), in one process
#      (benchmarks/module_ab.py: gradients against the module's, fwd+bwd times, each kernel's device time);
#   3. its steps, from each consumer's cycle counter (benchmarks/fused_bwd_trace.py);
#   a short table last. Every result goes under $OUT as it is measured. Stop 66 ran these by hand over five calls
#   (the first two with stop 65's schedule probe, benchmarks/fused_bwd_schedule_probe.py).
# On the device machine, from the repository root:
#   export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
#   bash benchmarks/fused_bwd_call.sh [cases]     # cases default: two of the #10 training rows
# The fused kernel is the default since stop 67, so the A/B is the module beside its three-kernel backward
# (switch gluon_fused_bwd=0); with BASE=path/to/an/older/rendering.py (carried: variant_tmp/, e.g. made by
# `git show <commit>:generated/gated_delta_rule.py > variant_tmp/gdr_base.py`) that module comes first; BASE may
# name several, in order. AB_SECONDS (default 150) is the A/B's time limit: ~45 s a module on a fresh machine.
# SWITCHES (default gluon_fused_bwd=0) are the A/B's switch rows, e.g. SWITCHES="state_pieces=1"; the trace runs
# TRACE_CASES (default 8,2048,16,16) with TRACE_SWITCHES set (comma-separated, e.g. "gluon_fused_bwd=0").
set -u
cases=${1:-"8,2048,16,16 1,32768,32,32"}
modules="${BASE:+$BASE }generated/gated_delta_rule.py"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu.txt"
case $(cat "$OUT/gpu.txt") in *H200*) card=h200;; *) card=h100;; esac
timeout ${AB_SECONDS:-150} python benchmarks/module_ab.py --modules "$modules" --switches "${SWITCHES:-gluon_fused_bwd=0}" \
    --cases "$cases" --profile --profile-rounds 3 --out "$OUT/$card-fused-ab.jsonl" > "$OUT/ab.log" 2>&1
timeout 90 python benchmarks/fused_bwd_trace.py --cases "${TRACE_CASES:-8,2048,16,16}" \
    --switches "${TRACE_SWITCHES:-}" --out "$OUT" > "$OUT/$card-trace.txt" 2>&1
timeout 180 python -m pytest -q -m gpu tests/test_gluon_state_gpu.py -k fused_backward -p no:cacheprovider \
    > "$OUT/$card-fused-gpu-tests.txt" 2>&1
cat "$OUT/gpu.txt"
grep -o '"variant.*kernels_us[^}]*}' "$OUT/ab.log" | cut -c1-300
tail -12 "$OUT/$card-trace.txt"
tail -3 "$OUT/$card-fused-gpu-tests.txt"
