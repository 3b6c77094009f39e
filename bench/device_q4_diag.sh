#!/usr/bin/env bash
# Q4_0 kernel diagnostics on the CUDA machine (after bench/device_run.sh has installed routemm):
# Nsight Compute stall and shared-memory metrics of bench/q4_profile.py's launches, and the SASS of
# the Q4 kernels (instruction mix of each function). Outputs in $OUT: q4-ncu.txt, q4-sass-summary.txt.
set -u
OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT"
metrics=smsp__inst_executed.sum,smsp__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active
for reason in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait lg_throttle not_selected selected dispatch_stall no_instruction; do
  metrics="$metrics,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio"
done
metrics="$metrics,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
metrics="$metrics,dram__bytes_read.sum,gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max,launch__cluster_max_active,launch__occupancy_limit_shared_mem,launch__registers_per_thread"
timeout 150 ncu --clock-control none -k regex:q4_ --metrics "$metrics" python3 bench/q4_profile.py > "$OUT/q4-ncu.txt" 2>&1
echo "ncu exit: $?" >> "$OUT/q4-ncu.txt"
so=$(cd /tmp && python3 -c "import routemm._core as c; print(c.__file__)")
cuobjdump -sass "$so" > /tmp/all.sass 2>&1
python3 - "$OUT/q4-sass-summary.txt" <<'PY'
import re, sys, collections
text = open("/tmp/all.sass").read()
out = []
for fn in re.split(r"\n\s*Function : ", text)[1:]:
    name = fn.split("\n", 1)[0]
    if "q4_" not in name:
        continue
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", fn)]
    count = collections.Counter(o.split(".")[0] for o in ops)
    out.append(f"{name[:160]}\n  {len(ops)} instructions: {count.most_common(30)}")
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
grep -E "q4_|inst_executed|stalled|bank_conflicts|duration|dram__bytes" "$OUT/q4-ncu.txt" | head -120
head -c 6000 "$OUT/q4-sass-summary.txt"
