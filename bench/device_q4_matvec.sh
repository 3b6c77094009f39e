#!/usr/bin/env bash
# Device run for the Q4_0 mat-vec (m <= 8): build (sm_90a), the CUDA halves of the Q4 tests and the
# SASS checks, compute-sanitizer memcheck and racecheck over the mat-vec tests (SANITIZE=1), the
# mat-vec bench at 4096 x 14336 and q_proj (m = 1, 2, 4, 8; records in $OUT/q4-mv.json), and the
# host-cost bench with its launch floor (HOST_COST=1), the one-token lab (LAB=1,
# bench/lab/mma_rows_device.sh). SKIP_BUILD=1 / SKIP_TESTS=1 skip those steps.
set -u
source "$(dirname "$0")/device_common.sh"
[ "${SKIP_BUILD:-0}" = 1 ] || build_and_report "q4_matvec"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp pytest
  ROUTEMM_TEST_BACKENDS=cuda timeout 240 python3 -m pytest tests/python/test_q4_matmul.py tests/python/test_cuda_sass.py \
    tests/python/test_calibration.py -q -x -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest.txt"
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  stamp memcheck
  ROUTEMM_TEST_BACKENDS=cuda timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
    tests/python/test_q4_matmul.py -q -x -p no:cacheprovider -k "(mat_vec or one_token) and not long_stream" > "$OUT/memcheck.txt" 2>&1
  echo "memcheck exit $?" | tee -a "$OUT/memcheck.txt"; tail -3 "$OUT/memcheck.txt"
  stamp racecheck
  ROUTEMM_TEST_BACKENDS=cuda timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest \
    tests/python/test_q4_matmul.py -q -x -p no:cacheprovider -k "few_token or one_token or unaligned_views or wide_range" > "$OUT/racecheck.txt" 2>&1
  echo "racecheck exit $?" | tee -a "$OUT/racecheck.txt"; tail -3 "$OUT/racecheck.txt"
fi
stamp bench
ROUTEMM_BENCH_Q4_SHAPES=${SHAPES:-4096x14336,q_proj} ROUTEMM_BENCH_Q4_MS=${MS:-1,2,4,8} ROUTEMM_BENCH_Q4_PEERS=${PEERS:-0} \
  BENCH_COMMAND="ROUTEMM_BENCH_Q4_SHAPES=${SHAPES:-4096x14336,q_proj} ROUTEMM_BENCH_Q4_MS=${MS:-1,2,4,8} python3 -m pytest bench/bench_cuda_q4_0_matmul.py -k default" \
  timeout 200 python3 -m pytest bench/bench_cuda_q4_0_matmul.py -q -s -p no:cacheprovider ${Q4_BENCH_ARGS:-} --results "$OUT/q4-mv.json" 2>&1 \
  | grep -E "us|!!|Error|error" | grep -v -i warn | tail -40
if [ "${HOST_COST:-0}" = 1 ]; then
  stamp host_cost
  BENCH_COMMAND="python3 bench/host_cost.py \$OUT/host_cost-h200.json" timeout 120 python3 bench/host_cost.py "$OUT/host_cost-h200.json" 2>&1 | tail -20
fi
if [ "${LAB:-0}" = 1 ]; then
  stamp lab
  LAB_NCU_SHAPES="${LAB_NCU_SHAPES:-0 2 3}" timeout 150 bash bench/lab/mma_rows_device.sh
fi
stamp done
