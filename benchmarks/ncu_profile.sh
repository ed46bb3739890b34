#!/usr/bin/env bash
# Nsight Compute over one warmed-up step of generated ops: per job "spec B,T,H,HV [fwd|bwd]",
# a report's raw metrics (CSV) and its details page (rules, stall reasons), tarred into
# $OUT/ncu.tar.gz with the logs. Clocks are left alone (--clock-control none). Words after the mode go
# to ncu_profile.py (and into the report's name).
#   bash benchmarks/ncu_profile.sh "gla 4,8192,16,16 bwd" "gated_delta_rule 1,32768,32,32 fwd --gluon-bv 64"
# NCU_SOURCE=1 adds per-instruction stall sampling (SourceCounters) and each report's SASS source page,
# $tag-source.csv, for benchmarks/ncu_source_summary.py. NCU_KERNEL (a regex) profiles only the kernels it
# matches, e.g. NCU_KERNEL=_chunk_bwd_gluon (SourceCounters replays each kernel many times).
set -u
OUT=${OUT:-bench_out}
work=$(mktemp -d)
for job in "$@"; do
  set -- $job
  spec=$1 case=$2 mode=${3:-bwd}
  shift $(( $# < 3 ? $# : 3 ))
  extra="$*"
  tag="$spec-${case//,/x}-$mode"
  [ -n "$extra" ] && tag="$tag$(echo "$extra" | tr -c 'A-Za-z0-9' '_')"
  flag=""; [ "$mode" = bwd ] && flag="--backward"
  timeout ${NCU_TIMEOUT:-240} ncu --profile-from-start off --clock-control none --kernel-name "regex:${NCU_KERNEL:-^_}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    --section SchedulerStats ${NCU_SOURCE:+--section SourceCounters --import-source no} \
    --export "$work/$tag" --force-overwrite \
    python3 benchmarks/ncu_profile.py --spec "$spec" --case "$case" $flag $extra > "$work/$tag.log" 2>&1
  echo "$tag rc=$?" | tee -a "$work/jobs.txt"
  if [ -f "$work/$tag.ncu-rep" ]; then
    ncu --import "$work/$tag.ncu-rep" --csv --page raw > "$work/$tag-raw.csv" 2>&1
    ncu --import "$work/$tag.ncu-rep" --page details > "$work/$tag-details.txt" 2>&1
    if [ -n "${NCU_SOURCE:-}" ]; then
      ncu --import "$work/$tag.ncu-rep" --page source --csv --print-source sass > "$work/$tag-source.csv" 2>&1
    fi
    rm -f "$work/$tag.ncu-rep"
  fi
done
tar -czf "$OUT/ncu.tar.gz" -C "$work" .
