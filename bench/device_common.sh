# Sourced by bench/device.sh and bench/lab/*.sh (run from the repo root): $OUT, a timestamp helper
# and the sm_90a build of the working tree.
export OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT"
device_start=$(date +%s)
elapsed() { echo $(( $(date +%s) - device_start )); }
stamp() { echo "[$(elapsed) s] $*"; }
# The card, as result files name it: h100, h200 or gpu (another card, or no nvidia-smi).
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE "h100|h200" |
  head -1 | tr '[:upper:]' '[:lower:]')
export CARD=${CARD:-gpu}

# build_sm90a [LOG]: pip-installs the working tree with the CUDA backend for sm_90a, ptxas -v on, the
# whole log in LOG (default $OUT/build.log); returns pip's status.
build_sm90a() {
  local log=${1:-$OUT/build.log}
  ROUTEMM_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 \
    SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90a;ROUTEMM_CUDA_PTXAS_VERBOSE=ON" \
    python3 -m pip install --no-build-isolation --no-deps -v . > "$log" 2>&1
}

# build_or_fail: build_sm90a unless SKIP_BUILD=1; on failure prints the log's tail and exits.
build_or_fail() {
  [ "${SKIP_BUILD:-0}" = 1 ] && return 0
  stamp build
  build_sm90a || { tail -30 "$OUT/build.log"; exit 1; }
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

# installed_module: the path of the installed routemm._core (read outside the source tree).
installed_module() {
  (cd /tmp && python3 -c "import routemm._core as c; print(c.__file__)")
}

# cuda_pytest TIMEOUT LOG FILES...: the given test files on the CUDA backend, stopping at the first
# failure; the last lines go to LOG and the terminal.
cuda_pytest() {
  local limit=$1 log=$2; shift 2
  stamp pytest
  ROUTEMM_TEST_BACKENDS=cuda timeout "$limit" python3 -m pytest "$@" -q -x -p no:cacheprovider 2>&1 | tail -5 | tee "$log"
}
