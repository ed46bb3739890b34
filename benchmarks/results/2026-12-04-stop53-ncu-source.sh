export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 ncu --profile-from-start off --clock-control none --kernel-name regex:_state_output_gluon --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters --section InstructionStats --section Occupancy \
  --import-source no --export $OUT/pass4x8192 --force-overwrite \
  python3 benchmarks/results/2026-12-04-stop53-ncu-bytes.py --case 4,8192,16,32 --steps 1 > $OUT/ncu.log 2>&1
echo "ncu rc=$?" >> $OUT/jobs.txt
ncu --import $OUT/pass4x8192.ncu-rep --page details > $OUT/details.txt 2>&1
ncu --import $OUT/pass4x8192.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>&1
echo "export rc=$?" >> $OUT/jobs.txt
ls -la $OUT
