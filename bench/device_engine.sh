#!/usr/bin/env bash
# The engine-loop work on the lent H200 (run from the repo root): build for sm_90a, then
#   1. the encoder / graph / torch-op tests on cpu and cuda (test_engine.py, test_torch_ops.py,
#      test_encoder.py: no-sync, no-allocation, no-stream checks and torch.cuda.graph capture run
#      on CUDA only) and the C++ lifecycle tests;
#   2. compute-sanitizer memcheck of the torch-op test file;
#   3. bench/engine_decode.py host-cost (one eager torch.ops.routemm.matmul_id call beside a bare
#      launch, syncs / cudaMalloc / streams counted) and decode-graph (48 Qwen3-30B-A3B layers,
#      eager, one CUDA graph, sum of kernel times, torch._grouped_mm).
# Everything lands in $OUT: build.log pytest.log sanitizer.log engine_host_cost-h200.json
# engine_decode_graph-h200.json bench.log. Env: SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_BENCH=1,
# LAYERS (decode-graph layers, default 48), GIT_REV.
set -u
source "$(dirname "$0")/device_common.sh"
export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

stamp build
build_sm90a "$OUT/build.log"; echo "pip exit $?" | tee -a "$OUT/build.log"
grep -E " error|Error" "$OUT/build.log" | head -5

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp pytest
  ROUTEMM_TEST_BACKENDS=cpu,cuda timeout 400 python3 -m pytest -q -p no:cacheprovider \
    tests/python/test_engine.py tests/python/test_torch_ops.py tests/python/test_encoder.py \
    tests/python/test_matmul_id.py > "$OUT/pytest.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/pytest.log"
  tail -15 "$OUT/pytest.log"
  stamp ctest
  cmake -S . -B /tmp/ctest -G Ninja -DROUTEMM_BUILD_TESTS=ON -DROUTEMM_BUILD_PYTHON=OFF \
    -DROUTEMM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a > /tmp/ctest-config.log 2>&1 &&
    cmake --build /tmp/ctest -j16 > /tmp/ctest-build.log 2>&1 &&
    ctest --test-dir /tmp/ctest -R "Encoder|Capture|AutoBarrier|CapturedGraph" >> "$OUT/pytest.log" 2>&1
  echo "ctest exit: $?" >> "$OUT/pytest.log"
  tail -4 "$OUT/pytest.log"
fi

if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
  stamp compute-sanitizer
  ROUTEMM_TEST_BACKENDS=cuda timeout 400 compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 -m pytest -q -p no:cacheprovider tests/python/test_torch_ops.py tests/python/test_engine.py \
    > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer exit: $?" >> "$OUT/sanitizer.log"
  tail -6 "$OUT/sanitizer.log"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stamp bench
  {
    python3 bench/engine_decode.py host-cost "$OUT/engine_host_cost-h200.json"
    python3 bench/engine_decode.py decode-graph "$OUT/engine_decode_graph-h200.json" --layers "${LAYERS:-48}"
  } > "$OUT/bench.log" 2>&1
  echo "bench exit: $?" >> "$OUT/bench.log"
  cat "$OUT/bench.log"
fi
stamp done
