#!/usr/bin/env bash
# One call on the lent H200 (run from the repo root): build + install routemm with the CUDA backend
# for sm_90a, run the backend-parametrised Python suite on cpu and cuda, a compute-sanitizer memcheck
# of a small expert-ID script, and the CUDA benchmark. Everything lands in $OUT (<= 8 files):
#   nvidia-smi.txt build.log pytest.log sanitizer.log bench.log dense_matmul_id-h200.json/.md
# Env: SKIP_SANITIZER=1 (tests without compute-sanitizer), GIT_REV (recorded in the results; pass it from the submitting checkout, whose git metadata
# the device copy may not carry), BENCH_ARGS (extra bench flags), SKIP_TESTS=1, SKIP_BENCH=1.
set -u
OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT"
export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> "$OUT/nvidia-smi.txt" 2>&1

stamp "build"
export ROUTEMM_CUDA=ON
export CMAKE_BUILD_PARALLEL_LEVEL=16
export SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90a;ROUTEMM_CUDA_PTXAS_VERBOSE=ON"
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a -DROUTEMM_CUDA_PTXAS_VERBOSE=ON"
{
  python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | grep -E "ptxas|spill|error|warning|Successfully|registers" | grep -v "^ptxas info    : Compile time"
  echo "pip exit: ${PIPESTATUS[0]}"
  so=$(cd /tmp && python3 -c "import routemm._core as c; print(c.__file__)")
  echo "module: $so"
  (cd /tmp && python3 -c "import routemm; print(routemm.backend_status()); d=routemm.Device('cuda'); print(d)")
  if command -v cuobjdump >/dev/null; then
    cuobjdump -sass "$so" > /tmp/sass.txt 2>&1
    python3 - <<'PY'
import re
text = open("/tmp/sass.txt").read()
for fn in re.split(r"\n\s*Function : ", text)[1:]:
    name = fn.split("\n", 1)[0]
    if "dense" not in name and "kernel" not in name:
        continue
    short = re.sub(r"_ZN7routemm4cuda\w+?_GLOBAL__N__\w+?(\d+)(direct|grouped|map)", r"\2", name)[:60]
    counts = {k: len(re.findall(k, fn)) for k in
              ["LDG.E.128", "LDG.E.ENL2.128", "LDG", "LDS.128", "LDS", "FFMA", "LDL", "STL", "SHFL"]}
    print("SASS", short, counts)
PY
  fi
} > "$OUT/build.log" 2>&1
tail -40 "$OUT/build.log"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp "pytest"
  ROUTEMM_TEST_BACKENDS=cpu,cuda timeout 200 python3 -m pytest tests/python -q -p no:cacheprovider \
    --continue-on-collection-errors --maxfail=40 > "$OUT/pytest.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/pytest.log"
  tail -25 "$OUT/pytest.log"

  [ "${SKIP_SANITIZER:-0}" = 1 ] || {
  stamp "compute-sanitizer"
  cat > /tmp/sanitize_case.py <<'PY'
import numpy as np, ml_dtypes, routemm
dev = routemm.Device("cuda"); reg = routemm.KernelRegistry(dev)
rng = np.random.default_rng(0)
for dt, k, n, m, top_k, E in [(np.float32, 35, 7, 9, 6, 8), (ml_dtypes.bfloat16, 64, 40, 33, 4, 16),
                              (np.float16, 2048, 96, 5, 8, 32), (np.float32, 72, 1030, 130, 8, 8),
                              (ml_dtypes.bfloat16, 72, 1030, 130, 8, 8)]:  # 680 grouped tiles
    w = rng.standard_normal((E, n, k)).astype(dt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = np.argsort(rng.random((m, E)), 1)[:, :top_k].astype(np.uint32)
    ids[0, 0] = 0xFFFFFFFF; ids[-1, -1] = E
    outs = {}
    for route in ("direct", "grouped_prefill"):
        outs[route] = routemm.matmul_id(w, x, ids, route=route, device=dev)
    assert np.array_equal(outs["direct"].view(np.uint32), outs["grouped_prefill"].view(np.uint32)), dt
    print("ok", np.dtype(dt).name, k, n, m, top_k, E)
# Q4_0: every pipeline on odd tails, an unaligned weight view (byte copies), K splits (clusters; the
# 4352 cases have empty splits) and, on Hopper, the bf16 routes' wgmma kernel (k % 256 == 0, aligned;
# 14336: every warp ring of the mat-vec wraps).
from routemm import q4_0
for m, n, k, offset in [(3, 200, 4096, 0), (40, 130, 800, 1), (130, 70, 2048, 0), (9, 33, 64, 2),
                          (20, 40, 4352, 0), (150, 136, 512, 0), (8, 200, 4352, 0), (1, 130, 14336, 0),
                          (5, 70, 2048, 2)]:
    w = q4_0.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32)).reshape(-1)
    raw = np.zeros(w.size + offset, np.uint8); raw[offset:] = w
    wbuf = dev.from_numpy(raw).view(offset, w.size, routemm.DType.U8, [w.size])
    x = dev.from_numpy(rng.uniform(-1, 1, (m, k)).astype(np.float32))
    p = routemm.GgmlQuantizedMatmulParams(m, n, k)
    routes = [None] + (list(routemm.DenseQ4Route) if m > 8 else [])
    for route in routes:
        out = dev.from_numpy(np.zeros((m, n), np.float32))
        enc = dev.command_encoder()
        if route is None:
            r = routemm.quantized_matmul_ggml(enc, reg, x, wbuf, out, p, routemm.GgmlRoutingPolicy())
        else:
            r = routemm.encode_q4_route(enc, reg, x, wbuf, out, p, route)
        enc.commit_and_wait()
        print("ok q4", m, n, k, offset, r.route, r.dispatch.grid)
PY
  if command -v compute-sanitizer >/dev/null; then
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 /tmp/sanitize_case.py > "$OUT/sanitizer.log" 2>&1
    echo "memcheck exit: $?" >> "$OUT/sanitizer.log"
    timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 /tmp/sanitize_case.py >> "$OUT/sanitizer.log" 2>&1
    echo "racecheck exit: $?" >> "$OUT/sanitizer.log"
  else
    echo "compute-sanitizer not found" > "$OUT/sanitizer.log"
  fi
  tail -8 "$OUT/sanitizer.log"
  }
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stamp "bench"
  # The recorded command names the bench flags too, so a record says how to measure it again.
  export BENCH_COMMAND="GIT_REV=$GIT_REV${BENCH_ARGS:+ BENCH_ARGS=\"$BENCH_ARGS\"} bash bench/device_run.sh"
  timeout $(( 500 - ($(date +%s) - start) )) python3 bench/bench_cuda_dense_matmul_id.py \
    "$OUT/dense_matmul_id-h200.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench exit: $?" >> "$OUT/bench.log"
  tail -90 "$OUT/bench.log"
fi

# ---- Q4_0 bench (optional): Q4_BENCH=0 skips it. Adds q4_0_matmul-h200.json/.md to $OUT and appends
# its log to bench.log. Narrow it with ROUTEMM_BENCH_Q4_SHAPES / ROUTEMM_BENCH_Q4_MS (see the bench's
# docstring) or Q4_BENCH_ARGS (extra pytest flags, word-split). It skips itself without Q4 pipelines.
# SIGINT on timeout lets pytest write the results it has.
if [ "${Q4_BENCH:-1}" != 0 ]; then
  stamp "q4 bench"
  left=$(( 590 - ($(date +%s) - start) ))
  if [ "$left" -gt 30 ]; then
    timeout -s INT -k 15 "$left" python3 -m pytest bench/bench_cuda_q4_0_matmul.py -q -s -p no:cacheprovider \
      --results "$OUT/q4_0_matmul-h200.json" ${Q4_BENCH_ARGS:-} >> "$OUT/bench.log" 2>&1
    echo "q4 bench exit: $?" >> "$OUT/bench.log"
  else
    echo "q4 bench: not run, ${left} s left" >> "$OUT/bench.log"
  fi
  tail -60 "$OUT/bench.log"
fi
stamp "done"
