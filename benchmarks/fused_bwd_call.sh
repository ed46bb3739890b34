#!/usr/bin/env bash
# The fused backward's first device call (docs/fused_backward.md, section 11; NOTES, stop 65), one script:
#   1. the schedule probe's floor (us a chunk, garbage data: benchmarks/fused_bwd_schedule_probe.py);
#   2. the GPU tests of the kernel (every gradient against float64 and the Triton stages);
#   3. the kernel (override gluon_fused_bwd) beside the three backward kernels it replaces, in one process
#      (benchmarks/module_ab.py: gradients against the module's, fwd+bwd times, each kernel's device time);
#   a short table last. Every result goes under $OUT as it is measured.
# On the device machine, from the repository root:
#   bash .anchors/install.sh > $OUT/install.log 2>&1; export PYTHONPATH=/tmp/anchors:$PWD PYTHONUNBUFFERED=1
#   bash benchmarks/fused_bwd_call.sh [cases]     # cases default: the three #10 training rows
set -u
cases=${1:-"8,2048,16,16 4,8192,16,32 1,32768,32,32"}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu.txt"
case $(cat "$OUT/gpu.txt") in *H200*) card=h200;; *) card=h100;; esac
timeout 150 python benchmarks/fused_bwd_schedule_probe.py --regs "128,192,24" --out "$OUT" > "$OUT/probe.log" 2>&1
timeout 240 python -m pytest -q -m gpu tests/test_gluon_state_gpu.py -k fused_backward -p no:cacheprovider \
    > "$OUT/$card-fused-gpu-tests.txt" 2>&1
timeout 400 python benchmarks/module_ab.py --modules generated/gated_delta_rule.py --switches gluon_fused_bwd=1 \
    --cases "$cases" --profile --profile-rounds 3 --out "$OUT/$card-fused-ab.jsonl" > "$OUT/ab.log" 2>&1
cat "$OUT/gpu.txt"
tail -2 "$OUT/probe.log"
tail -3 "$OUT/$card-fused-gpu-tests.txt"
tail -40 "$OUT/ab.log"
