#!/usr/bin/env bash
# The whole test suite: pytest against the installed package, then the C++ core under ctest.
# Extra CMake arguments for the ctest build go in ROUTEMM_CTEST_CMAKE_ARGS; its build folder in
# ROUTEMM_CTEST_BUILD_DIR (default build/ctest).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ROUTEMM_CTEST_BUILD_DIR:-$root/build/ctest}

python -m pytest "$root/tests/python" -q -p no:cacheprovider
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${ROUTEMM_CTEST_BUILD_TYPE:-Release} \
  -DROUTEMM_BUILD_TESTS=ON -DROUTEMM_BUILD_PYTHON=OFF ${ROUTEMM_CTEST_CMAKE_ARGS:-}
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
