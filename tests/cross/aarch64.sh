#!/usr/bin/env bash
# The CPU kernels on aarch64: cross-compiles the core's C++ tests (no Python, no CUDA/Metal) with
# g++-aarch64-linux-gnu and runs the CPU kernel tests under qemu-user, once with the NEON clones
# (ROUTEMM_CPU_ISA=neon) and once with the portable ones. The kernel tests themselves compare every
# runnable clone with the portable one bit for bit on the exact routes (tests/cpp/cpu_kernel_support.h).
# Installs the toolchain and qemu with apt where they are missing. Build folder: build/cross-aarch64
# (ROUTEMM_CROSS_OUT replaces it); only the CPU kernel suites are compiled
# (ROUTEMM_CPU_KERNEL_TESTS_ONLY). .ci/run runs it with ROUTEMM_CROSS_JOBS=2.
set -euo pipefail
cd "$(dirname "$0")/../.."

need_apt=()
command -v aarch64-linux-gnu-g++ >/dev/null || need_apt+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need_apt+=(qemu-user)
[ -f /usr/src/googletest/CMakeLists.txt ] || need_apt+=(googletest)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v cmake >/dev/null || need_apt+=(cmake)
if [ ${#need_apt[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

out="$(realpath -m "${ROUTEMM_CROSS_OUT:-build/cross-aarch64}")"
toolchain="$PWD/cmake/toolchains/aarch64-linux-gnu.cmake"
jobs="${ROUTEMM_CROSS_JOBS:-$(nproc)}"

# GoogleTest for the target, from the sources libgtest-dev/googletest ships (built once).
if [ ! -f "$out/gtest/lib/cmake/GTest/GTestConfig.cmake" ]; then
  cmake -S /usr/src/googletest -B "$out/gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DCMAKE_INSTALL_PREFIX="$out/gtest" \
    -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON >/dev/null 2>&1
  cmake --build "$out/gtest-build" -j"$jobs" >/dev/null
  cmake --install "$out/gtest-build" >/dev/null
fi

cmake -S . -B "$out/core" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_TOOLCHAIN_FILE="$toolchain" \
  -DGTest_DIR="$out/gtest/lib/cmake/GTest" -DROUTEMM_BUILD_TESTS=ON -DROUTEMM_BUILD_PYTHON=OFF \
  -DROUTEMM_CUDA=OFF -DROUTEMM_METAL=OFF -DROUTEMM_METAL_EMU=OFF -DROUTEMM_CPU_KERNEL_TESTS_ONLY=ON \
  >/dev/null
cmake --build "$out/core" -j"$jobs" --target routemm_tests

# The CPU kernel suites: the clone selection (CpuIsa), expert-ID float and quantised kernels,
# Q4_0/Q8_0 and the other GGML formats' kernels, the MoE kernels, the thread pool they run on.
# Q4Matmul.FailuresEncodeNothing checks front-door messages only (no kernel runs; the host suite
# has it).
filter='CpuIsa.*:CpuDenseMatmulIdKernels.*:CpuQuantizedMatmulIdKernels.*:CpuGgmlFormatKernels.*'
filter+=':CpuInt8DotKernels.*'
filter+=':Q4Format.*:Q4Matmul.*:Moe*:ThreadPool*-Q4Matmul.FailuresEncodeNothing'
filter="${ROUTEMM_CROSS_FILTER:-$filter}"
for isa in neon portable; do
  echo "== aarch64, ROUTEMM_CPU_ISA=$isa"
  ROUTEMM_CPU_ISA=$isa qemu-aarch64 -L /usr/aarch64-linux-gnu "$out/core/tests/cpp/routemm_tests" \
    --gtest_filter="$filter" --gtest_brief=1
done
# qemu's default CPU has the dot-product instructions (the int8-dot routes' SDOT clone); an
# Armv8.0 core (Cortex-A53) has not, and its int8-dot routes take the portable clone.
echo "== aarch64 without SDOT (cortex-a53), ROUTEMM_CPU_ISA=neon"
ROUTEMM_CPU_ISA=neon qemu-aarch64 -cpu cortex-a53 -L /usr/aarch64-linux-gnu \
  "$out/core/tests/cpp/routemm_tests" --gtest_filter='CpuIsa.*:CpuInt8DotKernels.*' --gtest_brief=1
echo "aarch64 cross tests ok"
