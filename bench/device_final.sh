#!/usr/bin/env bash
# The full H200 record in one call (run from the repo root, GIT_REV passed in): build + suite +
# sanitizers (bench/device_run.sh, expert-ID bench skipped), the whole Q4_0 bench with its peers,
# the Q4_0 route plan with real timings, and the spec §6.5 publication profile (cold, reactivation,
# reload) with one and with four weights per base. Results and receipts land in $OUT (calibration
# outputs packed in calibration.tar.gz). Env: CAL_WEIGHTS (default "1 4"), and device_run.sh's.
set -u
OUT=${OUT:-/tmp/routemm-out}
export PYTHONUNBUFFERED=1 SKIP_BENCH=1
bash bench/device_run.sh > "$OUT/run.log" 2>&1
grep -E "passed|failed|FAILED" "$OUT/pytest.log" | tail -4
grep -E "exit" "$OUT/sanitizer.log" 2>/dev/null; rm -f "$OUT/sanitizer.log" "$OUT/build.log" "$OUT/nvidia-smi.txt"
[ -f "$OUT/bench.log" ] && grep -E "routemm |torch_" "$OUT/bench.log" | awk '{print $1,$2,$3,$4,$5,$6,$7}' | head -150
repo=$(pwd)
mkdir -p /tmp/calibration
(cd /tmp && timeout 120 python3 "$repo/bench/device_q4_plan.py" /tmp/calibration/q4_plan_receipt-h200.json > "$OUT/q4_plan-h200.txt" 2>&1)
cat "$OUT/q4_plan-h200.txt"
for w in ${CAL_WEIGHTS:-1 4}; do
  (cd /tmp && GIT_REV=$GIT_REV timeout 200 python3 "$repo/bench/calibration_acceptance.py" /tmp/calibration $w 2>&1 | tee /tmp/calibration/acceptance-${w}w.txt | head -40)
done
tar -C /tmp -czf "$OUT/calibration.tar.gz" calibration
