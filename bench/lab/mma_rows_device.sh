#!/usr/bin/env bash
# Device script of bench/lab/q4_matvec_mma_rows_lab.cu: build, run every shape (checks, back-to-back
# times, the shape's plain read floor), ncu kernel durations per shape, and the stall ratios of the
# first two variants at 4096 x 14336; then bench/lab/read_floor_lab.cu (one kernel reading 4-512 MB
# once: back to back, and ncu durations per size). Output under $OUT.
set -u
nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -Icsrc/include -Icsrc -Icsrc/backend/cuda \
  -lineinfo -o /tmp/mma_rows bench/lab/q4_matvec_mma_rows_lab.cu || exit 1
/tmp/mma_rows > "$OUT/lab.txt" 2>&1
grep -E "n=|us per|FAIL|passed|launch failure" "$OUT/lab.txt" | grep -v " 0 rows over"
for i in ${LAB_NCU_SHAPES:-0 1 2 3 4}; do
  echo "== shape $i"
  LAB_SHAPE=$i ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:'q4_matvec_rows_kernel|lab_read' \
    /tmp/mma_rows > /tmp/ncu$i.csv 2>&1
  python3 bench/lab/ncu_durations.py /tmp/ncu$i.csv | sed 's/void routemm::cuda::q4_matvec_rows_kernel//; s/void lab_read_kernel/read floor/'
done 2>&1 | tee "$OUT/ncu_durations.txt"
for skip in 0 45; do
  LAB_SHAPE=0 ncu --clock-control none -k regex:q4_matvec_rows_kernel --launch-skip $skip --launch-count 1 \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
    /tmp/mma_rows 2>&1 | grep -vE " 0$|\(!\)" | grep -E "rows_kernel|stalled|inst_executed|issue_active|hmma|bank" \
    | awk '$NF+0 >= 0.05 || /kernel|inst|issue|hmma|bank/' 
done 2>&1 | tee "$OUT/ncu_stalls.txt"
nvcc -std=c++20 -arch=sm_90a -O3 -Icsrc/backend/cuda -o /tmp/read_floor bench/lab/read_floor_lab.cu \
  && /tmp/read_floor 2>&1 | tee "$OUT/read_floor.txt"
for mb in 4 8 16 25.2 33 64 128 256 512; do
  READ_FLOOR_MB=$mb ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:read_kernel \
    /tmp/read_floor > /tmp/ncu_rf.csv 2>&1
  echo "$mb MB: $(python3 bench/lab/ncu_durations.py /tmp/ncu_rf.csv | sed 's/void lab_read_kernel//' | tr '\n' ' ')"
done 2>&1 | tee -a "$OUT/read_floor.txt"
