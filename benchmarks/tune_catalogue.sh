#!/usr/bin/env bash
# Tune the catalogue specs on this GPU into one cache ($OUT/cache/<device>.json), seeded with the
# shipped table so the result is shipped + new entries (gdngen.autotune.cache.write_entries merges).
# A tune writes its cache when it finishes, so each spec x stage group runs under its own time limit:
# one slow spec cannot take the others' time. The log ($OUT/tune.log) has every table.
#   bash benchmarks/tune_catalogue.sh [SHAPE] [SECONDS_PER_RUN]
# env: SPECS (default: every spec but gated_delta_rule, whose chunk stages were tuned in stop 16),
#      RECURRENT_SPECS (default: all six), MAX_CANDIDATES (default 3), RECURRENT_LIMIT (default 90 s:
#      stop 17 gave 30 s and only gla finished - ~19 configs compile at ~1.5 s each)
set -u
out=${OUT:-tune_out}
shape=${1:-4,8192,16,16,128,128}
limit=${2:-70}
cands=${MAX_CANDIDATES:-3}
specs=${SPECS:-"simple_gla gla kda delta_rule linear_attn"}
recurrent_specs=${RECURRENT_SPECS:-"gated_delta_rule simple_gla gla kda delta_rule linear_attn"}
recurrent_limit=${RECURRENT_LIMIT:-90}
mkdir -p "$out/cache"
cache="$out/cache/nvidia-h200-sm90.json"
[ -f "$cache" ] || cp gdngen/autotune/shipped/h200.json "$cache"
for spec in $specs; do
  echo "=== $spec fwd+bwd at $shape (limit ${limit}s)"
  timeout "$limit" python3 -m gdngen.cli tune "$spec" --shapes "$shape" --stages all --chunk-sizes 64 \
    --max-candidates "$cands" --cache-dir "$out/cache"
  rc=$?; echo; echo "rc $rc"
done >> "$out/tune.log" 2>&1
for spec in $recurrent_specs; do
  echo "=== $spec recurrent (limit ${recurrent_limit}s)"
  timeout "$recurrent_limit" python3 -m gdngen.cli tune "$spec" --stages recurrent --cache-dir "$out/cache"
  rc=$?; echo; echo "rc $rc"     # the progress bar ends without a newline when a run is cut
done >> "$out/tune.log" 2>&1
grep -E "^===|^rc|wrote|x +[0-9]" "$out/tune.log"
