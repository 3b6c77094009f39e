#!/usr/bin/env bash
# build_ggml_peer.sh SRC_DIR BUILD_DIR [cuda|cpu]
# Configures a ggml source tree (SRC_DIR/ggml, e.g. the one a llama.cpp release vendors) together with
# bench/peer/ggml_mul_mat_peer.cpp and, when SRC_DIR/tests/test-backend-ops.cpp exists, the tree's own
# test-backend-ops, then builds them with ninja. cuda: the CUDA backend for sm_90a only (override with
# CUDA_ARCH), flash attention off, CUDA graphs on as llama.cpp's own build has them. cpu: CPU backend only.
# JOBS (default 16) sets the parallel jobs; EXTRA_CMAKE_ARGS is appended to the configure line.
# Binaries land in BUILD_DIR/bin.
set -eu
src=$(cd "${1:?SRC_DIR}" && pwd)
build=${2:?BUILD_DIR}
backend=${3:-cuda}
here=$(cd "$(dirname "$0")" && pwd)
label=""
[ -f "$src/VERSION" ] && label=$(head -1 "$src/VERSION")

args=(-G Ninja -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_SRC_DIR="$src"
  -DPEER_SOURCE_LABEL="$label" -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
  -DGGML_OPENMP=ON -DGGML_CPU_REPACK=OFF -DGGML_LLAMAFILE=ON -DBUILD_SHARED_LIBS=OFF)
if [ "$backend" = cuda ]; then
  args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a}" -DGGML_CUDA_FA=OFF
    -DGGML_CUDA_GRAPHS=ON -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_NATIVE=OFF)
else
  args+=(-DGGML_CUDA=OFF -DGGML_NATIVE=ON)
fi
# shellcheck disable=SC2206
args+=(${EXTRA_CMAKE_ARGS:-})
cmake "${args[@]}"
cmake --build "$build" -j "${JOBS:-16}"
