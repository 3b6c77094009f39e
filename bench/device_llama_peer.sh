#!/usr/bin/env bash
# Device run for the llama.cpp peer: builds ggml's CUDA backend (sm_90a, 16 jobs, flash attention off)
# from the unpacked llama.cpp tree in the ignored folder .dev/llama (carry it: carry=[".dev/llama"]),
# together with bench/peer/ggml_mul_mat_peer.cpp and the tree's own test-backend-ops, then times
#   - ggml_mul_mat_peer: MUL_MAT q4_0 4096 x 14336 and q_proj 4096 x 2048 (m = 1, 2, 3, 4, 5, 8) and
#     MUL_MAT_ID Qwen3-30B-A3B bf16 / q4_0 (m = 1, 8, 32), each L2-resident and rotated
#     -> $OUT/llama_peer.json, $OUT/llama_peer.log;
#   - test-backend-ops perf for the same MUL_MAT q4_0 and MUL_MAT_ID cases (llama.cpp's own numbers,
#     one weight reused, so L2-resident) -> $OUT/llama_peer_backend_ops.txt;
# and prints a compact table. The build log is $OUT/llama_peer_build.log. For m <= 8 ggml-cuda takes
# its mmvq mat-vec kernels (activations quantised to q8_1 first); for q4_0 at larger m its mmq kernels.
# Knobs: LLAMA_SRC (default .dev/llama), PEER_BUILD (default /tmp/ggml-peer-cuda; kept on a warm
# machine, so a second run skips the build), BUILD_ONLY=1 stops after the build, PEER_ARGS (extra
# harness arguments), BACKEND_OPS=0 skips test-backend-ops.
set -u
source "$(dirname "$0")/device_common.sh"
src=${LLAMA_SRC:-.dev/llama}
build=${PEER_BUILD:-/tmp/ggml-peer-cuda}
[ -f "$src/ggml/CMakeLists.txt" ] || { echo "no ggml tree at $src (carry .dev/llama)"; exit 2; }
head -1 "$src/VERSION" 2>/dev/null

# cuBLAS: the toolkit's when it has one, else the nvidia-cublas wheel beside PyTorch.
cublas_root=""
if ! ls /usr/local/cuda/lib64/libcublas.so* /usr/local/cuda/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
  cublas_root=$(python3 - <<'EOF'
import glob, os, site
for sp in site.getsitepackages():
    for inc in glob.glob(os.path.join(sp, "nvidia", "*", "include", "cublas_v2.h")):
        print(os.path.dirname(os.path.dirname(inc)))
        raise SystemExit
EOF
)
  echo "cuBLAS from ${cublas_root:-nowhere}"
fi
if [ -n "$cublas_root" ]; then
  export LD_LIBRARY_PATH="$cublas_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [ ! -x "$build/bin/ggml_mul_mat_peer" ]; then
  stamp "build ggml-cuda (sm_90a)"
  JOBS=16 EXTRA_CMAKE_ARGS="${cublas_root:+-DPEER_CUBLAS_ROOT=$cublas_root}" \
    timeout 420 bench/peer/build_ggml_peer.sh "$src" "$build" cuda > "$OUT/llama_peer_build.log" 2>&1
  rc=$?
  echo "build exit $rc"; grep -E "error|GGML_CUDA_NO_VMM|cuBLAS from" "$OUT/llama_peer_build.log" | head -8
  [ -x "$build/bin/ggml_mul_mat_peer" ] || { tail -20 "$OUT/llama_peer_build.log"; exit 1; }
fi
[ "${BUILD_ONLY:-0}" = 1 ] && { stamp "built"; exit 0; }

stamp "ggml_mul_mat_peer"
timeout 200 "$build/bin/ggml_mul_mat_peer" --backend cuda --json "$OUT/llama_peer.json" ${PEER_ARGS:-} \
  > "$OUT/llama_peer.log" 2>&1
echo "harness exit $?"
grep -v "^peer " "$OUT/llama_peer.log" | head -5

if [ "${BACKEND_OPS:-1}" = 1 ] && [ -x "$build/bin/test-backend-ops" ]; then
  stamp "test-backend-ops perf"
  {
    timeout 60 "$build/bin/test-backend-ops" perf -b CUDA0 -o MUL_MAT \
      -p 'type_a=q4_0,type_b=f32,m=4096,n=[0-9],k=14336,'
    timeout 60 "$build/bin/test-backend-ops" perf -b CUDA0 -o MUL_MAT_ID \
      -p 'type_a=(q4_0|f16),type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=(1|8|32),k=2048,'
  } > "$OUT/llama_peer_backend_ops.txt" 2>&1
  sed 's/\x1b\[[0-9;]*m//g; s/  */ /g' "$OUT/llama_peer_backend_ops.txt" | grep -E "MUL_MAT|FAIL|rror" | head -24
fi

stamp table
python3 - "$OUT/llama_peer.json" <<'EOF'
import json
import sys

rows = json.load(open(sys.argv[1]))
if rows:
    print(rows[0]["peer"], "on", rows[0]["device"])
print(f"{'op':<10} {'type':<5} {'shape':<14} {'m':>3} {'mode':<8} {'us':>9} {'TB/s':>6} {'rel_err':>9}")
for r in rows:
    print(
        f"{r['op']:<10} {r['type']:<5} {r['shape']:<14} {r['m']:>3} {r['mode']:<8} {r['us']:>9.2f} "
        f"{r['tbps']:>6.2f} {r['rel_err']:>9.2e}{'' if r['ok'] else ' FAIL'}"
    )
EOF
stamp done
