#!/usr/bin/env bash
# The GPU test tier in parallel pytest processes (compilation is CPU-bound: 16 cores on the H200
# machine), one merged log so a device call returns one file ($OUT/gpu_tier.log; the device tool
# returns at most 8 files). Usage: bash benchmarks/gpu_tier.sh [TIMEOUT_S] [GROUP ...]
# Groups are pytest -k expressions over tests/test_*_gpu.py; the default covers every GPU test.
# pytest -v: a group cut by the time limit still shows which of its tests passed (stop 15, run 9).
set -u
limit=${1:-280}
shift || true
out=${OUT:-gpu_out}
mkdir -p "$out"
if [ "$#" -eq 0 ]; then
  set -- "linear_attn and not backward" "simple_gla and not backward" "gla and not simple_gla and not backward" \
         "delta_rule and not gated and not backward" "gated_delta_rule and not backward" "kda and not backward" \
         "backward and (gla or kda)" "backward and not gla and not kda" \
         "(not realistic and not head_dims and not backward) or decode_realistic"
fi
tmp=$(mktemp -d)
i=0
for group in "$@"; do
  i=$((i + 1))
  timeout "$limit" python3 -m pytest -v -rf --tb=line tests/test_kernels_gpu.py tests/test_backward_gpu.py \
    tests/test_serving_gpu.py tests/test_layers_gpu.py -k "$group" > "$tmp/$i.log" 2>&1 &
  echo "$group" > "$tmp/$i.name"
done
wait
for f in "$tmp"/*.log; do
  n=${f%.log}
  { echo "=== group: $(cat "$n.name")"; cat "$f"; echo; } >> "$out/gpu_tier.log"
done
grep -E "^=== group|PASSED|FAILED|passed|failed|error" "$out/gpu_tier.log"
