#!/usr/bin/env bash
# The forward pass on one device call: its GPU tests, the module beside a switch in no-grad forward (kernel us,
# benchmarks/module_ab.py), then #10's forward rows beside FlashQLA (gdngen bench), a short table last. Every
# result goes under $OUT as it is measured.
# On the device machine, from the repository root (.anchors carried: bash ../shared/tools/anchors.sh .anchors):
#   SWITCHES="compact_t=0" TESTS="compact or triton_pass" bash benchmarks/forward_call.sh [cases]
# SWITCHES: the A/B's switch rows (default compact_t=0: stop 70's compact T off); TESTS: pytest -k of
# tests/test_gluon_state_gpu.py; AB_SECONDS (default 200) and BENCH_SECONDS (default 300): the steps' limits.
set -u
cases=${1:-"1,32768,32,32 4,8192,16,32 8,2048,16,16"}
bash .anchors/install.sh > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/anchors:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu.txt"
case $(cat "$OUT/gpu.txt") in *H200*) card=h200;; *) card=h100;; esac
timeout 200 python -m pytest -q -m gpu tests/test_gluon_state_gpu.py -k "${TESTS:-compact or triton_pass}" \
    -p no:cacheprovider > "$OUT/$card-forward-gpu-tests.txt" 2>&1
timeout ${AB_SECONDS:-200} python benchmarks/module_ab.py --modules generated/gated_delta_rule.py \
    --switches "${SWITCHES:-compact_t=0}" --modes fwd --cases "$cases" --profile --profile-rounds 3 \
    --out "$OUT/$card-forward-ab.jsonl" > "$OUT/ab.log" 2>&1
timeout ${BENCH_SECONDS:-300} python -m gdngen.cli bench gated_delta_rule --cases "$cases" --impls gdngen,flashqla \
    --modes fwd --time-budget 250 --out "$OUT/$card-forward-bench.json" > "$OUT/bench.log" 2>&1
cat "$OUT/gpu.txt"
tail -3 "$OUT/$card-forward-gpu-tests.txt"
grep -o '"variant.*kernels_us[^}]*}' "$OUT/ab.log" | cut -c1-260
tail -15 "$OUT/bench.log"
