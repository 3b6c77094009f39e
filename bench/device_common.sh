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

# build_and_report PATTERN: stamps and runs build_sm90a (log in /tmp/build.log), then writes the
# ptxas register and spill lines of the kernels matching PATTERN to $OUT/ptxas.txt and prints them
# with the build's first errors or warnings.
build_and_report() {
  stamp build
  build_sm90a /tmp/build.log; echo "pip exit $?"
  grep -E -A3 "$1" /tmp/build.log | grep -E "registers|spill" | sort | uniq -c > "$OUT/ptxas.txt"
  cat "$OUT/ptxas.txt"; grep -E " error|warning" /tmp/build.log | head -5
}
