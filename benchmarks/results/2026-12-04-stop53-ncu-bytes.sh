export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum
for c in 1,131072,16,32 4,8192,16,32 1,32768,32,32; do
  timeout 150 ncu --profile-from-start off --clock-control none --kernel-name regex:"_state_output_gluon|_wy_fwd" \
    --metrics $M --csv python3 benchmarks/results/2026-12-04-stop53-ncu-bytes.py --case $c --steps 3 > $OUT/ncu_${c//,/x}.csv 2> $OUT/ncu_${c//,/x}.err
  echo "$c rc=$?" >> $OUT/jobs.txt
done
