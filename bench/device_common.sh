# Sourced by the bench/device_*.sh scripts (run from the repo root): $OUT, a timestamp helper and the
# sm_90a build of the working tree.
OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT"
device_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - device_start )) s] $*"; }

# build_sm90a [LOG]: pip-installs the working tree with the CUDA backend for sm_90a, ptxas -v on, the
# whole log in LOG (default $OUT/build.log); returns pip's status.
build_sm90a() {
  local log=${1:-$OUT/build.log}
  ROUTEMM_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 \
    SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90a;ROUTEMM_CUDA_PTXAS_VERBOSE=ON" \
    python3 -m pip install --no-build-isolation --no-deps -v . > "$log" 2>&1
}
