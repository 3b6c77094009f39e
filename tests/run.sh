#!/usr/bin/env bash
# The whole test suite: pytest against the installed package (installed from this checkout first
# when it is not there), then the C++ core under ctest.
#
# Arguments go to pytest (e.g. `bash tests/run.sh -k demo`). Extra CMake arguments for the ctest
# build go in ROUTEMM_CTEST_CMAKE_ARGS; its build folder in ROUTEMM_CTEST_BUILD_DIR (default
# build/ctest). Where nvidia-smi lists no GPU, the ctest build leaves the CUDA sources out
# (ROUTEMM_CUDA=OFF) unless ROUTEMM_CTEST_CMAKE_ARGS names ROUTEMM_CUDA itself.
#
# When cmake, ninja or GoogleTest is missing, the C++ part is skipped with a message saying how to
# install them. The exit status is non-zero when pytest or the C++ tests fail; a skipped C++ part
# leaves it to pytest. The last line (on stderr) sums up both halves; where the C++ half did not
# run it says why and gives the one command that installs what it needs and runs this script again.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ROUTEMM_CTEST_BUILD_DIR:-$root/build/ctest}
jobs=$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)

# On a machine where routemm (or what its tests need) is not installed yet, install this checkout
# with its test extra first, so that this one command also works on a fresh machine; after the
# README's first command it finds the install and builds nothing.
if ! python -c "import routemm, pytest, hypothesis" >/dev/null 2>&1; then
  echo "run.sh: routemm or its test dependencies are not installed: python -m pip install \"$root[test]\""
  python -m pip install "$root[test]" || { echo "run.sh: the install failed" >&2; exit 1; }
fi

python -m pytest "$root/tests/python" -q -p no:cacheprovider "$@"
status=$?

pytest_summary() {
  if [ "$status" -eq 0 ]; then echo "pytest passed"; else echo "pytest FAILED (exit $status)"; fi
}

# The one command that installs the C++ tests' tools here (cmake, ninja, GoogleTest).
install_command() {
  if [[ "${OSTYPE:-}" == darwin* ]]; then
    echo "brew install cmake ninja googletest"
  elif [ -x /usr/bin/dnf ] && [ ! -x /usr/bin/apt-get ]; then
    echo "sudo dnf install cmake ninja-build gtest-devel"
  else
    echo "sudo apt-get install cmake ninja-build libgtest-dev"
  fi
}

skip_cpp() {
  cat >&2 <<EOF
run.sh: C++ tests NOT run: $1.
  They need cmake, ninja and GoogleTest. Install them with
    Debian/Ubuntu:  sudo apt-get install cmake ninja-build libgtest-dev
    Fedora:         sudo dnf install cmake ninja-build gtest-devel
    macOS:          brew install cmake ninja googletest
  (cmake and ninja also come from pip: python -m pip install cmake ninja), then run this script again.
EOF
  echo "run.sh: $(pytest_summary); C++ tests NOT run ($1). Fix: $(install_command) && bash tests/run.sh" >&2
  exit "$status"
}

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v ninja >/dev/null 2>&1 || missing+=(ninja)
[ ${#missing[@]} -eq 0 ] || skip_cpp "${missing[*]} not found on PATH"

cmake_args=()
if [[ "${ROUTEMM_CTEST_CMAKE_ARGS:-}" != *ROUTEMM_CUDA* ]] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "run.sh: no NVIDIA GPU found (nvidia-smi): the C++ tests are built without the CUDA sources (ROUTEMM_CUDA=OFF)"
  cmake_args+=(-DROUTEMM_CUDA=OFF)
fi

configure_log=$(mktemp)
trap 'rm -f "$configure_log"' EXIT
# shellcheck disable=SC2086
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${ROUTEMM_CTEST_BUILD_TYPE:-Release}" \
  -DROUTEMM_BUILD_TESTS=ON -DROUTEMM_BUILD_PYTHON=OFF ${cmake_args[@]+"${cmake_args[@]}"} \
  ${ROUTEMM_CTEST_CMAKE_ARGS:-} >"$configure_log" 2>&1; then
  if grep -q 'GTest' "$configure_log"; then
    skip_cpp "CMake found no GoogleTest (find_package(GTest))"
  fi
  cat "$configure_log" >&2
  echo "run.sh: configuring the C++ tests failed" >&2
  exit 1
fi
cat "$configure_log"
if ! cmake --build "$build" -j"$jobs"; then
  echo "run.sh: $(pytest_summary); building the C++ tests FAILED" >&2
  exit 1
fi
if ! ctest --test-dir "$build" --output-on-failure -j"$jobs"; then
  echo "run.sh: $(pytest_summary); C++ tests FAILED" >&2
  exit 1
fi
echo "run.sh: $(pytest_summary); C++ tests passed" >&2
exit "$status"
