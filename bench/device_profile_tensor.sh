#!/usr/bin/env bash
# Nsight Compute profile of the Hopper tensor-route kernel (grouped_wgmma_kernel) on the named
# shape:m cases (bench/lowp_profile.py), plus the host cost of one call (bench/host_cost.py). Builds
# first unless SKIP_BUILD=1. Everything lands in $OUT: ncu-<case>.txt, ncu-src-<case>.txt (top stall
# lines), host_cost-h200.json/.md.
set -u
source "$(dirname "$0")/device_common.sh"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build_sm90a || { tail -20 "$OUT/build.log"; exit 1; }
fi
for case in ${CASES:-qwen3-30b-a3b:4096 deepseek-v3:4096}; do
  tag=${case/:/-}
  timeout 150 ncu --clock-control none -k regex:grouped_wgmma --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy python3 bench/lowp_profile.py "$case" > "$OUT/ncu-$tag.txt" 2>&1
  echo "ncu $case exit $?"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|L1/TEX Hit|L2 Hit" "$OUT/ncu-$tag.txt" | head -14
  timeout 150 ncu --clock-control none -k regex:grouped_wgmma --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 bench/lowp_profile.py "$case" > /tmp/src.csv 2>/dev/null
  python3 bench/ncu_top_stalls.py /tmp/src.csv 14 > "$OUT/ncu-src-$tag.txt" 2>&1; head -14 "$OUT/ncu-src-$tag.txt"
done
[ "${HOST_COST:-1}" = 1 ] && timeout 120 python3 bench/host_cost.py "$OUT/host_cost-h200.json" 2>&1 | tail -8
