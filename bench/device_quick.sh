#!/usr/bin/env bash
# A short H200 call for one change (run from the repo root, GIT_REV passed in): build with the CUDA
# backend for sm_90a, the CUDA halves of the given test files (TESTS, default: the expert-ID
# numerics and the Q4 matmul tests), then the commands in QUICK_BENCH (one per line, run from the
# repo root with $OUT set), each with its output in $OUT/quick-<n>.log. Everything lands in $OUT.
set -u
OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
export ROUTEMM_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a"
stamp build
python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
stamp tests
ROUTEMM_TEST_BACKENDS=cuda timeout 240 python3 -m pytest ${TESTS:-tests/python/test_dense_matmul_id_numerics.py tests/python/test_q4_matmul.py} \
  -q -p no:cacheprovider -x > "$OUT/pytest.log" 2>&1
echo "pytest exit: $?" >> "$OUT/pytest.log"
tail -4 "$OUT/pytest.log"
n=0
while IFS= read -r cmd; do
  [ -z "$cmd" ] && continue
  n=$((n + 1))
  stamp "quick $n: $cmd"
  (eval "$cmd") > "$OUT/quick-$n.log" 2>&1
  echo "exit: $?" >> "$OUT/quick-$n.log"
  tail -${QUICK_TAIL:-30} "$OUT/quick-$n.log"
done <<< "${QUICK_BENCH:-}"
stamp done
