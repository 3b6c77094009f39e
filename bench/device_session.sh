#!/usr/bin/env bash
# One H200 call that records everything in priority order, so a call cut short still returns the
# most important results (run from the repo root, GIT_REV passed in):
#   1. build + suite (cpu, cuda) + compute-sanitizer (bench/device_run.sh, benches off);
#   2. the Q4_0 route plan with real timings and the spec §6.5 acceptance profile with CAL_WEIGHTS
#      (default "1 4") weights per base  -> calibration.tar.gz;
#   3. the Q4_0 bench (narrow it with ROUTEMM_BENCH_Q4_SHAPES / _MS / _PEERS) until BENCH_UNTIL_S
#      (default 480 s after the start)   -> q4_0_matmul-h200.json/.md, bench.log;
#   4. Nsight Compute diagnostics of the Q4 kernels if DIAG=1 (default) and time is left -> diag.tar.gz.
# Logs of step 1 and 2 land in logs.tar.gz. At most 6 files in $OUT.
set -u
OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT" /tmp/logs /tmp/calibration
export PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

OUT=/tmp/logs SKIP_BENCH=1 Q4_BENCH=0 bash bench/device_run.sh > /tmp/logs/run.log 2>&1
grep -E "passed|failed|FAILED" /tmp/logs/pytest.log | tail -4
grep -E "exit" /tmp/logs/sanitizer.log 2>/dev/null
echo "[$(elapsed) s] suite done"

repo=$(pwd)
(cd /tmp && timeout 120 python3 "$repo/bench/device_q4_plan.py" /tmp/calibration/q4_plan_receipt-h200.json > /tmp/logs/q4_plan-h200.txt 2>&1)
head -3 /tmp/logs/q4_plan-h200.txt
for w in ${CAL_WEIGHTS:-1 4}; do
  (cd /tmp && GIT_REV=$GIT_REV timeout 150 python3 "$repo/bench/calibration_acceptance.py" /tmp/calibration $w 2>&1 | tee /tmp/calibration/acceptance-${w}w.txt | head -1)
done
tar -C /tmp -czf "$OUT/calibration.tar.gz" calibration
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
echo "[$(elapsed) s] calibration done"

left=$(( ${BENCH_UNTIL_S:-480} - $(elapsed) ))
if [ "$left" -gt 30 ]; then
  export BENCH_COMMAND="GIT_REV=$GIT_REV bash bench/device_session.sh"
  timeout -s INT -k 15 "$left" python3 -m pytest bench/bench_cuda_q4_0_matmul.py -q -s -p no:cacheprovider \
    --results "$OUT/q4_0_matmul-h200.json" > "$OUT/bench.log" 2>&1
  echo "q4 bench exit: $? (${left} s allowed)" >> "$OUT/bench.log"
  grep -E "routemm |torch_" "$OUT/bench.log" | cut -c1-150 | head -90
fi
echo "[$(elapsed) s] bench done"

if [ "${DIAG:-1}" = 1 ] && [ "$(elapsed)" -lt 500 ]; then
  mkdir -p /tmp/diag
  OUT=/tmp/diag timeout $(( 570 - $(elapsed) )) bash bench/device_q4_diag.sh > /tmp/diag/summary.txt 2>&1
  tar -C /tmp -czf "$OUT/diag.tar.gz" diag
  grep -E "q4_matvec|q4_kernel|gpu__time|inst_executed|cycles_active|cluster_max" /tmp/diag/q4-ncu.txt | cut -c1-140 | head -40
fi
echo "[$(elapsed) s] done"
