#!/usr/bin/env bash
# The C++ test binary with the CUDA backend, built on a machine without a GPU and run on one that
# has it: a device call then spends no time building (a full CUDA build takes minutes there).
#
#   bash bench/prebuilt_cpp_tests.sh build [DIR]   # here: HEAD built for sm_90a into DIR (.dev/cbin)
#   bash bench/prebuilt_cpp_tests.sh run [DIR]     # on the device (carry DIR): the fused block's
#                                                  # tests, compute-sanitizer over them, the suite
#
# The binary links libstdc++, libgcc, gtest and cudart statically (about 25 MB), so it runs on the
# device's newer glibc. Tests that read the source tree (its absolute path is compiled in) fail
# there; the suite's list of failures is for reading, the fused and CUDA tests are the check.
set -euo pipefail
cd "$(dirname "$0")/.."
command=${1:-}
dir=${2:-.dev/cbin}

case "$command" in
  build)
    src=$(mktemp -d)
    git archive HEAD | tar -x -C "$src"
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROUTEMM_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90a -DROUTEMM_BUILD_PYTHON=OFF -DROUTEMM_BUILD_TESTS=ON \
      -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" > /dev/null
    ninja -C "$src/build" -j"${JOBS:-2}" routemm_tests
    mkdir -p "$dir"
    cp "$src/build/tests/cpp/routemm_tests" "$dir/"
    git rev-parse --short HEAD > "$dir/REV"
    rm -rf "$src"
    echo "built $(cat "$dir/REV") into $dir"
    ;;
  run)
    out=${OUT:-/tmp/routemm-out}
    mkdir -p "$out"
    cd "$dir"
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/card.txt"
    echo "revision $(cat REV 2>/dev/null || echo unknown)"
    timeout 120 ./routemm_tests --gtest_filter='MoeExpertsFused*:*Cuda*' 2>&1 | tail -15 | tee "$out/fused.log"
    set +e
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ./routemm_tests \
      --gtest_filter='MoeExpertsFused.Matches*' 2>&1 | tail -8 | tee "$out/sanitizer.log"
    echo "sanitizer rc ${PIPESTATUS[0]}" | tee -a "$out/sanitizer.log"
    timeout 300 ./routemm_tests --gtest_brief=1 > "$out/suite.log" 2>&1
    echo "suite rc $?"
    grep -E "FAILED|PASSED|tests ran" "$out/suite.log" | tail -40
    ;;
  *)
    sed -n 2,8p "$0"
    exit 2
    ;;
esac
