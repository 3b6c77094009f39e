#!/usr/bin/env bash
# Where the tensor-route kernel's memory traffic comes from (ncu metrics on grouped_wgmma_kernel):
# DRAM bytes read, and L2 read sectors with their hit counts split into the L1TEX unit's requests
# (the producers' cp.async activation gather) and all requests (plus TMA's weight tiles). Cases:
# shape:m pairs for bench/lowp_profile.py (CASES). Assumes routemm is installed (SKIP_BUILD=0 builds).
set -u
source "$(dirname "$0")/device_common.sh"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build_sm90a || { tail -20 "$OUT/build.log"; exit 1; }
fi
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,gpu__time_duration.sum
for case in ${CASES:-deepseek-v3:4096 qwen3-30b-a3b:4096}; do
  echo "== $case"
  timeout 150 ncu --clock-control none -k regex:grouped_wgmma --launch-skip 1 --launch-count 1 --metrics $M \
    python3 bench/lowp_profile.py "$case" 2>&1 | grep -E "dram__|lts__|gpu__time" | tee -a "$OUT/l2-split.txt"
done
