#!/usr/bin/env bash
# Runs on a CUDA machine, from the repo root: builds the working tree for sm_90a and measures or
# checks one area. Outputs land in $OUT (default /tmp/routemm-out), at most 8 files per command.
#
#   bash bench/device.sh COMMAND [ARGS]     # bash bench/device.sh help: the commands and their knobs
#
# Knobs are environment variables; every command takes SKIP_BUILD=1 (use the installed build) and
# GIT_REV (the revision results record; pass it from the submitting checkout, whose git metadata the
# device copy may not carry). docs/development.md describes each command.
set -u
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: bash bench/device.sh COMMAND [ARGS]

  suite            build; the Python suite on cuda; compute-sanitizer memcheck and racecheck
                   of bench/tools/cuda_checks.py; the expert-ID benchmark, then the Q4_0 benchmark
                   -> nvidia-smi.txt build.log pytest.log sanitizer.log bench.log and the results
                   JSON/Markdown. Knobs: SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_BENCH=1 (expert-ID),
                   TEST_BACKENDS (default cuda: CI runs the CPU half), TEST_FILES (default
                   tests/python; not through `batch`, whose knobs cannot hold spaces),
                   PYTEST_TIMEOUT (default 420 s: the CUDA half took 391 s on an H100),
                   Q4_BENCH=0, BENCH_ARGS, Q4_BENCH_ARGS, ROUTEMM_BENCH_Q4_SHAPES / _MS / _PEERS.
  session          everything in priority order, so a call cut short still returns the most
                   important: suite (no benchmarks), the Q4_0 plan with real timings and the
                   calibration acceptance profile (CAL_WEIGHTS, default "1 4") -> calibration.tar.gz,
                   logs.tar.gz; the Q4_0 benchmark until BENCH_UNTIL_S (default 480 s); then
                   `profile q4` when DIAG=1 (default) and time is left -> diag.tar.gz.
  quick            build, the CUDA half of TESTS (default: the expert-ID numerics and Q4 matmul
                   tests), then each line of QUICK_BENCH as a command -> quick-<n>.log (QUICK_TAIL
                   lines shown, default 30).
  demo             the demo at its default and full Qwen3-30B-A3B sizes, and the expert-ID map
                   dispatch timed alone (bench/tools/map_timing.py).
  q4-matvec        the Q4_0 mat-vec (m <= 8): build with its ptxas report, its tests, the benchmark
                   at SHAPES (default 4096x14336,q_proj) and MS (default 1,2,4,8) -> q4-mv.json.
                   Knobs: SKIP_TESTS=1, SANITIZE=1, HOST_COST=1, LAB=1 (`lab mma-rows` after),
                   PEERS, Q4_BENCH_ARGS.
  tensor           the tensor-core expert-ID routes: build with its ptxas report, their tests, K/N
                   tails (bench/tools/tensor_tails.py), per-kernel timing beside torch._grouped_mm
                   at SHAPES x MS (bench/tools/tensor_timing.py; BENCH_T seconds). Knobs:
                   SKIP_TESTS=1, SANITIZE=1.
  profile WHAT     Nsight Compute (after a build, unless SKIP_BUILD=1):
                     tensor    the Hopper tensor kernel's sections and top stall lines per CASES
                               (shape:m, default qwen3-30b-a3b:4096 deepseek-v3:4096), then
                               bench/host_cost.py (HOST_COST=0 skips it)
                     l2-split  DRAM bytes and L2 sectors by source unit for the same kernel
                     q4        stall and shared-memory metrics of bench/tools/q4_profile.py's
                               launches, and the instruction mix of each Q4 kernel's SASS
                     qid       the quantised expert-ID kernels per QID_CASES (bench/tools/
                               qid_profile.py's TYPE:SHAPE-PROJ:M:ROUTE): times, sections and
                               top stall lines per case
  peer             llama.cpp's ggml CUDA backend timed on the same shapes (bench/peer/; carry
                   .dev/llama). Knobs: LLAMA_SRC, PEER_BUILD, BUILD_ONLY=1, PEER_ARGS, BACKEND_OPS=0.
  engine           the engine-loop work: build; the encoder / graph / torch-op tests on cpu and cuda
                   (tests/python/test_engine.py, test_torch_ops.py, test_torch_kernels.py,
                   test_encoder.py, test_matmul_id.py)
                   and the C++ encoder lifecycle tests; compute-sanitizer memcheck of the torch-op
                   and engine tests; bench/engine_decode.py host-cost (one eager
                   torch.ops.routemm.matmul_id call beside a bare launch) and decode-graph (LAYERS
                   Qwen3-30B-A3B layers, default 48: eager, one CUDA graph, torch._grouped_mm)
                   -> build.log pytest.log sanitizer.log bench.log engine_host_cost-<card>.json
                   engine_decode_graph-<card>.json. Knobs: SKIP_TESTS=1, SKIP_SANITIZER=1,
                   SKIP_BENCH=1, LAYERS.
  host-cost        the torch ops' host cost with both kernel sets: build with torch visible and
                   ROUTEMM_TORCH_OPS=ON (the C++ kernels, routemm._torch_ops, must build), check
                   that routemm.torch loads them, then bench/engine_decode.py host-cost as is (the
                   op on the C++ kernels beside the Python kernel behind an op of its own, a bare
                   launch and a do-nothing Python op) and again with ROUTEMM_TORCH_KERNELS=python
                   -> build.log bench.log engine_host_cost-<card>.json
                   engine_host_cost_python-<card>.json. Knobs: SKIP_BUILD=1, CALLS, BATCHES.
  qid              the quantised expert-ID matmul and the MoE block: build; the CUDA tests of the
                   quantised expert-ID op (its tensor-core route and machine code included), the
                   routing-map reuse and the MoE layer; then bench/tools/qid_timing.py (Q4_0/Q8_0
                   on Qwen3-30B-A3B and Qwen3.6-35B-A3B at MS, the automatic route and, for m > 8,
                   grouped_tensor_lowp, beside torch._grouped_mm and the copy floor; the
                   Qwen3-30B-A3B block beside transformers) -> pytest.txt qid.jsonl quantized_matmul_id-<card>.json/.md
                   moe_block-<card>.json/.md; bench/tools/qid_format_timing.py (Q4_K, Q6_K, MXFP4 on
                   Qwen3-30B-A3B and gpt-oss-20b at MS beside the copy floor; its JSON lines in
                   qid.jsonl, its table after quantized_matmul_id-<card>.md's; FORMATS=0 skips it);
                   then the llama.cpp peer's MUL_MAT_ID q4_0 at the same shapes and MS (as `peer`;
                   carry .dev/llama) -> llama_peer.json llama_peer.log, joined row by row with
                   routemm's fastest route (bench/tools/peer_compare.py) after the table.
                   Knobs: SKIP_TESTS=1, MS (default 1,8,32,512,4096), QID_ARGS (more tool flags),
                   PEER=0 (no peer), PEER_TYPES (ggml type names, default q4_0; e.g.
                   q4_0,q4_K,q6_K,mxfp4), PEER_SHAPES (default qwen3_30b_a3b,qwen3.6_35b_a3b; also
                   qwen3_30b_a3b_down, gpt_oss_20b), LLAMA_SRC, PEER_BUILD. The peer's first build takes minutes: on
                   a cold machine run `BUILD_ONLY=1 bash bench/device.sh peer` in a call of its own.
  direct-path      the quantised expert-ID direct kernel's two data paths (ROUTEMM_CUDA_DIRECT_PATH):
                   build; tests/python/test_cuda_direct_data_path.py and test_quantized_matmul_id.py on
                   cuda; compute-sanitizer memcheck and racecheck of the direct tests; then
                   bench/tools/qid_timing.py (Q4_0 and Q8_0, Qwen3-30B-A3B and Qwen3.6-35B-A3B, MS
                   default 1,8) under loads and bulk, alternated ROUNDS times (default 2)
                   -> direct_path.tar.gz (pytest.log sanitizer.log qid-<path>-<round>/).
                   Knobs: SKIP_TESTS=1, SKIP_SANITIZER=1.
  lab mma-rows     bench/lab/q4_matvec_mma_rows_lab.cu and bench/lab/read_floor_lab.cu with Nsight
                   Compute kernel durations (LAB_NCU_SHAPES, default "0 1 2 3 4").
  ab PATCH CMD     a same-machine A/B of a change: PATCH is a diff that the tree already holds (make
                   it with `git diff BASE -- csrc > .dev/change.diff` and carry .dev/change.diff);
                   builds and runs the shell line CMD with the change, reverts it (patch -R),
                   builds and runs CMD without, and so on for ROUNDS pairs (default 2, with first),
                   rebuilding incrementally; the tree is left as it came. Each run's output goes to
                   ab-<n>-<with|without>.log in $OUT, its last AB_TAIL lines (default 12) to the
                   console. CMD may write files into $AB_OUT (a folder per run, packed into
                   ab.tar.gz). Example:
                   bash bench/device.sh ab .dev/change.diff "python3 bench/tools/qid_timing.py ..."
                   Stacked changes: PATCH may list diffs as P1:P2:...:Pn in the order they were
                   made (each a diff over the one before it). Each round then runs CMD with all of
                   them ("with"), then reverts them last first, running CMD after each revert
                   ("without-Pn", "without-Pn-...-P1", labels by file name without .diff).
  block            the MoE block where users meet it: build with the torch ops (ROUTEMM_TORCH_OPS=ON);
                   the CUDA tests of the fused decode route, the block op, batch_invariant, the GGML
                   formats and the transformers experts; compute-sanitizer memcheck of the fused
                   route's tests; bench/tools/transformers_block.py (Qwen3-30B-A3B, Mixtral-8x7B,
                   eager and CUDA graph, beside grouped_mm / batched_mm); the 48-layer
                   bench/tools/transformers_model.py -> pytest.log sanitizer.log transformers_block-<card>.*
                   transformers_model-<card>.*. Knobs: SKIP_TESTS=1, SKIP_SANITIZER=1, MODELS,
                   CALLS (default 20), MODEL=0 (no whole model), DECODE (default 32).
  batch CMD...      several commands in one call, in the order given: the first builds (unless
                   SKIP_BUILD=1), the rest reuse its build. A CMD may carry knobs of its own after a
                   colon ("qid:PEER=0 MS=1,8"). Each writes into a folder of its own, packed into
                   $OUT/<cmd>.tar.gz as soon as it ends, so a call cut short still returns what
                   finished; each runs under what is left of BATCH_UNTIL_S (default 570 s).
                   Example: bash bench/device.sh batch host-cost tensor "qid:PEER=0"
  help             this text.
EOF
}

# ---- suite ----------------------------------------------------------------------------------------

suite_build() {
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
    >> "$OUT/nvidia-smi.txt" 2>&1
  [ "${SKIP_BUILD:-0}" = 1 ] && return 0
  stamp build
  {
    build_sm90a /tmp/build-full.log
    echo "pip exit: $?"
    grep -E "ptxas|spill|error|warning|Successfully|registers" /tmp/build-full.log \
      | grep -v "^ptxas info    : Compile time"
    local so
    so=$(installed_module)
    echo "module: $so"
    (cd /tmp && python3 -c "import routemm; print(routemm.backend_status()); print(routemm.Device('cuda'))")
    if command -v cuobjdump >/dev/null; then
      cuobjdump -sass "$so" > /tmp/sass.txt 2>&1
      python3 bench/tools/sass_summary.py /tmp/sass.txt loads
    fi
  } > "$OUT/build.log" 2>&1
  tail -40 "$OUT/build.log"
}

suite_tests() {
  stamp pytest
  ROUTEMM_TEST_BACKENDS=${TEST_BACKENDS:-cuda} timeout "${PYTEST_TIMEOUT:-420}" \
    python3 -m pytest ${TEST_FILES:-tests/python} -q -p no:cacheprovider \
    --continue-on-collection-errors --maxfail=40 --durations=12 > "$OUT/pytest.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/pytest.log"
  tail -25 "$OUT/pytest.log"
  [ "${SKIP_SANITIZER:-0}" = 1 ] && return 0
  stamp compute-sanitizer
  if command -v compute-sanitizer >/dev/null; then
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/tools/cuda_checks.py \
      > "$OUT/sanitizer.log" 2>&1
    echo "memcheck exit: $?" >> "$OUT/sanitizer.log"
    timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 bench/tools/cuda_checks.py \
      >> "$OUT/sanitizer.log" 2>&1
    echo "racecheck exit: $?" >> "$OUT/sanitizer.log"
  else
    echo "compute-sanitizer not found" > "$OUT/sanitizer.log"
  fi
  tail -8 "$OUT/sanitizer.log"
}

# q4_bench SECONDS_LEFT LOG: the Q4_0 benchmark into $OUT/q4_0_matmul-<card>.json/.md, its log
# appended to LOG; SIGINT on timeout lets pytest write the results it has. Narrowed by
# ROUTEMM_BENCH_Q4_SHAPES / _MS / _PEERS (see the bench's docstring) or Q4_BENCH_ARGS (pytest flags,
# word-split); it skips itself without Q4 pipelines.
q4_bench() {
  local left=$1 log=$2
  stamp "q4 bench"
  if [ "$left" -gt 30 ]; then
    timeout -s INT -k 15 "$left" python3 -m pytest bench/bench_cuda_q4_0_matmul.py -q -s -p no:cacheprovider \
      --results "$OUT/q4_0_matmul-${CARD}.json" ${Q4_BENCH_ARGS:-} >> "$log" 2>&1
    echo "q4 bench exit: $? (${left} s allowed)" >> "$log"
  else
    echo "q4 bench: not run, ${left} s left" >> "$log"
  fi
}

cmd_suite() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  suite_build
  [ "${SKIP_TESTS:-0}" = 1 ] || suite_tests
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    stamp bench
    # The recorded command names the bench flags too, so a record says how to measure it again.
    export BENCH_COMMAND="GIT_REV=$GIT_REV${BENCH_ARGS:+ BENCH_ARGS=\"$BENCH_ARGS\"} bash bench/device.sh suite"
    local left=$(( 500 - $(elapsed) ))
    if [ "$left" -gt 30 ]; then
      timeout "$left" python3 bench/bench_cuda_dense_matmul_id.py \
        "$OUT/dense_matmul_id-${CARD}.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
      echo "bench exit: $?" >> "$OUT/bench.log"
      tail -90 "$OUT/bench.log"
    else
      echo "expert-ID bench: not run, ${left} s left" | tee "$OUT/bench.log"
    fi
  fi
  if [ "${Q4_BENCH:-1}" != 0 ]; then
    q4_bench $(( 590 - $(elapsed) )) "$OUT/bench.log"
    tail -60 "$OUT/bench.log"
  fi
  stamp done
}

# ---- session --------------------------------------------------------------------------------------

cmd_session() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export PYTHONUNBUFFERED=1
  local final=$OUT repo
  repo=$(pwd)
  mkdir -p /tmp/logs /tmp/calibration
  # The suite's tests get 200 s here (not its own 420), so the plan and benchmarks after it run.
  OUT=/tmp/logs SKIP_BENCH=1 Q4_BENCH=0 PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-200} bash bench/device.sh suite \
    > /tmp/logs/run.log 2>&1
  grep -E "passed|failed|FAILED" /tmp/logs/pytest.log | tail -4
  grep -E "exit" /tmp/logs/sanitizer.log 2>/dev/null
  stamp "suite done"

  (cd /tmp && timeout 120 python3 "$repo/bench/q4_plan.py" /tmp/calibration/q4_plan_receipt-${CARD}.json \
    > /tmp/logs/q4_plan-${CARD}.txt 2>&1)
  head -3 /tmp/logs/q4_plan-${CARD}.txt
  local w
  for w in ${CAL_WEIGHTS:-1 4}; do
    (cd /tmp && timeout 150 python3 "$repo/bench/calibration_acceptance.py" /tmp/calibration "$w" 2>&1 \
      | tee "/tmp/calibration/acceptance-${w}w.txt" | head -1)
  done
  tar -C /tmp -czf "$final/calibration.tar.gz" calibration
  tar -C /tmp -czf "$final/logs.tar.gz" logs
  stamp "calibration done"

  export BENCH_COMMAND="GIT_REV=$GIT_REV bash bench/device.sh session"
  : > "$final/bench.log"
  q4_bench $(( ${BENCH_UNTIL_S:-480} - $(elapsed) )) "$final/bench.log"
  grep -E "routemm |torch_" "$final/bench.log" | cut -c1-150 | head -90
  stamp "bench done"

  if [ "${DIAG:-1}" = 1 ] && [ "$(elapsed)" -lt 500 ]; then
    mkdir -p /tmp/diag
    OUT=/tmp/diag SKIP_BUILD=1 timeout $(( 570 - $(elapsed) )) bash bench/device.sh profile q4 \
      > /tmp/diag/summary.txt 2>&1
    tar -C /tmp -czf "$final/diag.tar.gz" diag
    grep -E "q4_matvec|q4_kernel|gpu__time|inst_executed|cycles_active|cluster_max" /tmp/diag/q4-ncu.txt \
      | cut -c1-140 | head -40
  fi
  stamp done
}

# ---- quick ----------------------------------------------------------------------------------------

cmd_quick() {
  build_or_fail
  stamp tests
  ROUTEMM_TEST_BACKENDS=cuda timeout 240 python3 -m pytest \
    ${TESTS:-tests/python/test_dense_matmul_id_numerics.py tests/python/test_q4_matmul.py} \
    -q -p no:cacheprovider -x > "$OUT/pytest.log" 2>&1
  echo "pytest exit: $?" >> "$OUT/pytest.log"
  tail -4 "$OUT/pytest.log"
  local n=0 cmd
  while IFS= read -r cmd; do
    [ -z "$cmd" ] && continue
    n=$((n + 1))
    stamp "quick $n: $cmd"
    (eval "$cmd") > "$OUT/quick-$n.log" 2>&1
    echo "exit: $?" >> "$OUT/quick-$n.log"
    tail -"${QUICK_TAIL:-30}" "$OUT/quick-$n.log"
  done <<< "${QUICK_BENCH:-}"
  stamp done
}

# ---- demo -----------------------------------------------------------------------------------------

cmd_demo() {
  build_or_fail
  local repo
  repo=$(pwd)
  (
    cd /tmp || exit 1
    python3 -m routemm demo | tee "$OUT/demo.txt"
    python3 -m routemm demo --model qwen3-30b-a3b --tokens 512 --json > "$OUT/demo-qwen3-30b-a3b.json"
    python3 -c "import json; r = json.load(open('$OUT/demo-qwen3-30b-a3b.json')); print('full qwen3 ok:', r['ok'], [(x['m'], x['route'], round(x['time_us'], 1)) for x in r['runs']])"
    python3 "$repo/bench/tools/map_timing.py" | tee "$OUT/map.txt"
  )
}

# ---- q4-matvec ------------------------------------------------------------------------------------

cmd_q4_matvec() {
  [ "${SKIP_BUILD:-0}" = 1 ] || build_and_report "q4_matvec"
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    cuda_pytest 240 "$OUT/pytest.txt" tests/python/test_q4_matmul.py tests/python/test_cuda_sass.py \
      tests/python/test_calibration.py
  fi
  if [ "${SANITIZE:-0}" = 1 ]; then
    stamp memcheck
    ROUTEMM_TEST_BACKENDS=cuda timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
      tests/python/test_q4_matmul.py -q -x -p no:cacheprovider -k "(mat_vec or one_token) and not long_stream" \
      > "$OUT/memcheck.txt" 2>&1
    echo "memcheck exit $?" | tee -a "$OUT/memcheck.txt"; tail -3 "$OUT/memcheck.txt"
    stamp racecheck
    ROUTEMM_TEST_BACKENDS=cuda timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest \
      tests/python/test_q4_matmul.py -q -x -p no:cacheprovider -k "few_token or one_token or unaligned_views or wide_range" \
      > "$OUT/racecheck.txt" 2>&1
    echo "racecheck exit $?" | tee -a "$OUT/racecheck.txt"; tail -3 "$OUT/racecheck.txt"
  fi
  stamp bench
  local shapes=${SHAPES:-4096x14336,q_proj} ms=${MS:-1,2,4,8}
  ROUTEMM_BENCH_Q4_SHAPES=$shapes ROUTEMM_BENCH_Q4_MS=$ms ROUTEMM_BENCH_Q4_PEERS=${PEERS:-0} \
    BENCH_COMMAND="ROUTEMM_BENCH_Q4_SHAPES=$shapes ROUTEMM_BENCH_Q4_MS=$ms python3 -m pytest bench/bench_cuda_q4_0_matmul.py -k default" \
    timeout 200 python3 -m pytest bench/bench_cuda_q4_0_matmul.py -q -s -p no:cacheprovider ${Q4_BENCH_ARGS:-} \
    --results "$OUT/q4-mv.json" 2>&1 | grep -E "us|!!|Error|error" | grep -v -i warn | tail -40
  if [ "${HOST_COST:-0}" = 1 ]; then
    stamp host_cost
    BENCH_COMMAND="python3 bench/host_cost.py \$OUT/host_cost-${CARD}.json" timeout 120 \
      python3 bench/host_cost.py "$OUT/host_cost-${CARD}.json" 2>&1 | tail -20
  fi
  if [ "${LAB:-0}" = 1 ]; then
    stamp lab
    LAB_NCU_SHAPES="${LAB_NCU_SHAPES:-0 2 3}" timeout 150 bash bench/device.sh lab mma-rows
  fi
  stamp done
}

# ---- tensor ---------------------------------------------------------------------------------------

cmd_tensor() {
  [ "${SKIP_BUILD:-0}" = 1 ] || build_and_report "grouped_(tensor|wgmma)_kernel"
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    cuda_pytest 120 "$OUT/pytest.txt" tests/python/test_dense_matmul_id_tensor.py \
      tests/python/test_dense_matmul_id_numerics.py tests/python/test_dense_matmul_id_capture_receipts.py -k "not q4"
    stamp tails
    timeout 60 python3 bench/tools/tensor_tails.py 2>&1 | tail -40 | tee -a "$OUT/tails.txt" | grep -E "BAD|bad|Error"
  fi
  stamp bench
  timeout "${BENCH_T:-120}" python3 bench/tools/tensor_timing.py "${SHAPES:-qwen3-30b-a3b,mixtral-8x7b,deepseek-v3}" \
    "${MS:-512,4096}" 2>&1 | grep -v -i warn | tee -a "$OUT/bench.txt"
  if [ "${SANITIZE:-0}" = 1 ]; then
    stamp sanitize
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/tools/tensor_tails.py short \
      > "$OUT/memcheck.txt" 2>&1
    echo "memcheck exit $?" | tee -a "$OUT/memcheck.txt"; tail -4 "$OUT/memcheck.txt"
    timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 bench/tools/tensor_tails.py short \
      > "$OUT/racecheck.txt" 2>&1
    echo "racecheck exit $?" | tee -a "$OUT/racecheck.txt"; tail -4 "$OUT/racecheck.txt"
  fi
  stamp done
}

# ---- profile --------------------------------------------------------------------------------------

# ncu_tensor ARGS...: Nsight Compute of the second launch of the Hopper tensor kernel.
ncu_tensor() {
  timeout 150 ncu --clock-control none -k regex:grouped_wgmma --launch-skip 1 --launch-count 1 "$@"
}

profile_tensor() {
  local case tag
  for case in ${CASES:-qwen3-30b-a3b:4096 deepseek-v3:4096}; do
    tag=${case/:/-}
    ncu_tensor --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy python3 bench/tools/lowp_profile.py "$case" > "$OUT/ncu-$tag.txt" 2>&1
    echo "ncu $case exit $?"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|L1/TEX Hit|L2 Hit" \
      "$OUT/ncu-$tag.txt" | head -14
    ncu_tensor --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python3 bench/tools/lowp_profile.py "$case" > /tmp/src.csv 2>/dev/null
    python3 bench/tools/ncu_top_stalls.py /tmp/src.csv 14 > "$OUT/ncu-src-$tag.txt" 2>&1
    head -14 "$OUT/ncu-src-$tag.txt"
  done
  [ "${HOST_COST:-1}" = 1 ] && timeout 120 python3 bench/host_cost.py "$OUT/host_cost-${CARD}.json" 2>&1 | tail -8
}

profile_l2_split() {
  local case m=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum
  m=$m,lts__t_sectors_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum
  m=$m,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,gpu__time_duration.sum
  for case in ${CASES:-deepseek-v3:4096 qwen3-30b-a3b:4096}; do
    echo "== $case"
    ncu_tensor --metrics "$m" python3 bench/tools/lowp_profile.py "$case" 2>&1 \
      | grep -E "dram__|lts__|gpu__time" | tee -a "$OUT/l2-split.txt"
  done
}

profile_q4() {
  local reason metrics=smsp__inst_executed.sum,smsp__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active
  for reason in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait lg_throttle \
    not_selected selected dispatch_stall no_instruction; do
    metrics="$metrics,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio"
  done
  metrics="$metrics,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
  metrics="$metrics,dram__bytes_read.sum,gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max"
  metrics="$metrics,launch__cluster_max_active,launch__occupancy_limit_shared_mem,launch__registers_per_thread"
  timeout 150 ncu --clock-control none -k regex:q4_ --metrics "$metrics" python3 bench/tools/q4_profile.py \
    > "$OUT/q4-ncu.txt" 2>&1
  echo "ncu exit: $?" >> "$OUT/q4-ncu.txt"
  cuobjdump -sass "$(installed_module)" > /tmp/all.sass 2>&1
  python3 bench/tools/sass_summary.py /tmp/all.sass mix q4_ "$OUT/q4-sass-summary.txt"
  grep -E "q4_|inst_executed|stalled|bank_conflicts|duration|dram__bytes" "$OUT/q4-ncu.txt" | head -120
  head -c 6000 "$OUT/q4-sass-summary.txt"
}

# The quantised expert-ID kernels per QID_CASES (bench/tools/qid_profile.py's TYPE:SHAPE-PROJ:M:ROUTE):
# each case's GPU time per call, then per case the speed-of-light, memory and warp-state sections
# and the top stall lines of its kernel -> qid-times.txt, ncu-qid-<case>.txt, ncu-src-qid-<case>.txt.
profile_qid() {
  local case tag kernel
  local cases=${QID_CASES:-q4_0:qwen3-30b-a3b-up:512:lowp q4_k:qwen3-30b-a3b-up:512:lowp q4_k:qwen3-30b-a3b-up:1:direct}
  timeout 120 python3 bench/tools/qid_profile.py --time $cases 2>&1 | tee "$OUT/qid-times.txt"
  for case in $cases; do
    tag=${case//:/-}
    case "$case" in *:lowp) kernel=grouped_tensor_kernel ;; *:grouped) kernel=grouped_kernel ;; *) kernel=direct ;; esac
    timeout 100 ncu --clock-control none -k regex:"$kernel" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats python3 bench/tools/qid_profile.py "$case" > "$OUT/ncu-qid-$tag.txt" 2>&1
    echo "== $case (ncu exit $?)"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|L1/TEX Hit|L2 Hit|Registers Per|Achieved Occupancy|Stall" \
      "$OUT/ncu-qid-$tag.txt" | head -16
    timeout 100 ncu --clock-control none -k regex:"$kernel" --launch-skip 1 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python3 bench/tools/qid_profile.py "$case" > /tmp/src.csv 2>/dev/null
    python3 bench/tools/ncu_top_stalls.py /tmp/src.csv 16 > "$OUT/ncu-src-qid-$tag.txt" 2>&1
    head -16 "$OUT/ncu-src-qid-$tag.txt"
  done
}

cmd_profile() {
  local what=${1:-}
  case "$what" in
    tensor | l2-split | q4 | qid) ;;
    *) echo "profile needs one of: tensor, l2-split, q4, qid" >&2; return 2 ;;
  esac
  build_or_fail
  case "$what" in
    tensor) profile_tensor ;;
    l2-split) profile_l2_split ;;
    q4) profile_q4 ;;
    qid) profile_qid ;;
  esac
}

# ---- peer -----------------------------------------------------------------------------------------

# Builds ggml's CUDA backend (sm_90a, 16 jobs, flash attention off) from the unpacked llama.cpp tree
# in the ignored folder .dev/llama (carry it), together with bench/peer/ggml_mul_mat_peer.cpp and the
# tree's own test-backend-ops, then times
#   - ggml_mul_mat_peer: MUL_MAT q4_0 4096 x 14336 and q_proj 4096 x 2048 (m = 1, 2, 3, 4, 5, 8) and
#     MUL_MAT_ID Qwen3-30B-A3B bf16 / q4_0 (m = 1, 8, 32), each L2-resident and rotated
#     -> llama_peer.json, llama_peer.log;
#   - test-backend-ops perf for the same MUL_MAT q4_0 and MUL_MAT_ID cases (llama.cpp's own numbers,
#     one weight reused, so L2-resident) -> llama_peer_backend_ops.txt;
# and prints a compact table; the build log is llama_peer_build.log. For m <= 8 ggml-cuda takes its
# mmvq mat-vec kernels (activations quantised to q8_1 first); for q4_0 at larger m its mmq kernels.
# PEER_BUILD (default /tmp/ggml-peer-cuda) is kept on a warm machine, so a second run skips the build.
cmd_peer() {
  local src=${LLAMA_SRC:-.dev/llama} build=${PEER_BUILD:-/tmp/ggml-peer-cuda} cublas_root=""
  [ -f "$src/ggml/CMakeLists.txt" ] || { echo "no ggml tree at $src (carry .dev/llama)"; exit 2; }
  head -1 "$src/VERSION" 2>/dev/null
  # cuBLAS: the toolkit's when it has one, else the nvidia-cublas wheel beside PyTorch.
  if ! ls /usr/local/cuda/lib64/libcublas.so* /usr/local/cuda/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
    cublas_root=$(python3 bench/tools/cublas_root.py)
    echo "cuBLAS from ${cublas_root:-nowhere}"
  fi
  if [ -n "$cublas_root" ]; then
    export LD_LIBRARY_PATH="$cublas_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  if [ ! -x "$build/bin/ggml_mul_mat_peer" ]; then
    stamp "build ggml-cuda (sm_90a)"
    JOBS=16 EXTRA_CMAKE_ARGS="${cublas_root:+-DPEER_CUBLAS_ROOT=$cublas_root}" \
      timeout 420 bench/peer/build_ggml_peer.sh "$src" "$build" cuda > "$OUT/llama_peer_build.log" 2>&1
    echo "build exit $?"
    grep -E "error|GGML_CUDA_NO_VMM|cuBLAS from" "$OUT/llama_peer_build.log" | head -8
    [ -x "$build/bin/ggml_mul_mat_peer" ] || { tail -20 "$OUT/llama_peer_build.log"; exit 1; }
  fi
  [ "${BUILD_ONLY:-0}" = 1 ] && { stamp built; return 0; }

  stamp ggml_mul_mat_peer
  timeout 200 "$build/bin/ggml_mul_mat_peer" --backend cuda --json "$OUT/llama_peer.json" ${PEER_ARGS:-} \
    > "$OUT/llama_peer.log" 2>&1
  echo "harness exit $?"
  grep -v "^peer " "$OUT/llama_peer.log" | head -5
  if [ "${BACKEND_OPS:-1}" = 1 ] && [ -x "$build/bin/test-backend-ops" ]; then
    stamp "test-backend-ops perf"
    {
      timeout 60 "$build/bin/test-backend-ops" perf -b CUDA0 -o MUL_MAT \
        -p 'type_a=q4_0,type_b=f32,m=4096,n=[0-9],k=14336,'
      timeout 60 "$build/bin/test-backend-ops" perf -b CUDA0 -o MUL_MAT_ID \
        -p 'type_a=(q4_0|f16),type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=(1|8|32),k=2048,'
    } > "$OUT/llama_peer_backend_ops.txt" 2>&1
    sed 's/\x1b\[[0-9;]*m//g; s/  */ /g' "$OUT/llama_peer_backend_ops.txt" | grep -E "MUL_MAT|FAIL|rror" | head -24
  fi
  stamp table
  python3 bench/tools/peer_table.py "$OUT/llama_peer.json"
  stamp done
}

# ---- qid ------------------------------------------------------------------------------------------

cmd_qid() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  local ms=${MS:-1,8,32,512,4096}
  build_or_fail
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    cuda_pytest 360 "$OUT/pytest.txt" tests/python/test_quantized_matmul_id.py \
      tests/python/test_quantized_matmul_id_validation.py tests/python/test_quantized_matmul_id_tensor.py \
      tests/python/test_cuda_sass.py tests/python/test_expert_id_map_reuse.py \
      tests/python/test_moe.py tests/python/test_moe_gguf.py tests/python/test_transformers_experts.py \
      tests/python/test_ggml_format_kernels.py tests/python/test_ggml_format_kernels_cuda.py
  fi
  stamp qid_timing
  # JSON lines to qid.jsonl, progress to the terminal; the tool keeps itself under 150 s.
  BENCH_COMMAND="GIT_REV=$GIT_REV MS=$ms${QID_ARGS:+ QID_ARGS=\"$QID_ARGS\"} bash bench/device.sh qid" \
    timeout 180 python3 bench/tools/qid_timing.py --out "$OUT" --ms "$ms" ${QID_ARGS:-} > "$OUT/qid.jsonl"
  echo "qid_timing exit: $?"
  if [ "${FORMATS:-1}" = 1 ]; then
    stamp qid_format_timing
    timeout 180 python3 bench/tools/qid_format_timing.py --out /tmp/qid-formats --ms "$ms" --budget-s 150 \
      >> "$OUT/qid.jsonl"
    echo "qid_format_timing exit: $?"
    { echo; echo "Block formats beyond Q4_0 / Q8_0 (bench/tools/qid_format_timing.py):"; echo
      cat "/tmp/qid-formats/qid_formats-${CARD}.md"; } >> "$OUT/quantized_matmul_id-${CARD}.md" 2>/dev/null
  fi
  cat "$OUT/quantized_matmul_id-${CARD}.md" "$OUT/moe_block-${CARD}.md" 2>/dev/null | grep -E "^\| |^Ceil"
  if [ "${PEER:-1}" = 1 ]; then
    # The peer's build log stays in /tmp, so that this command's files stay within eight.
    (OUT=/tmp/qid-peer; mkdir -p "$OUT"
      PEER_ARGS="--only mul_mat_id --moe-types ${PEER_TYPES:-q4_0} --moe-ms $ms --moe-shapes ${PEER_SHAPES:-qwen3_30b_a3b,qwen3.6_35b_a3b}" \
        BACKEND_OPS=0 cmd_peer)
    cp /tmp/qid-peer/llama_peer.json /tmp/qid-peer/llama_peer.log "$OUT/" 2>/dev/null
    # routemm's fastest route beside the peer, row by row, after quantized_matmul_id's table.
    python3 bench/tools/peer_compare.py "$OUT/qid.jsonl" "$OUT/llama_peer.json" --out /tmp/qid-peer \
      --card "$CARD" && { echo; echo "Beside llama.cpp (bench/tools/peer_compare.py):"; echo
      cat "/tmp/qid-peer/qid_vs_llama-${CARD}.md"; } >> "$OUT/quantized_matmul_id-${CARD}.md"
  fi
  stamp done
}

# ---- lab ------------------------------------------------------------------------------------------

# bench/lab/q4_matvec_mma_rows_lab.cu: build, run every shape (checks, back-to-back times, the
# shape's plain read floor), ncu kernel durations per shape, and the stall ratios of the first two
# variants at 4096 x 14336; then bench/lab/read_floor_lab.cu (one kernel reading 4-512 MB once: back
# to back, and ncu durations per size) -> lab.txt, ncu_durations.txt, ncu_stalls.txt, read_floor.txt.
lab_mma_rows() {
  local i skip mb
  nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -Icsrc/include -Icsrc -Icsrc/backend/cuda \
    -lineinfo -o /tmp/mma_rows bench/lab/q4_matvec_mma_rows_lab.cu || exit 1
  /tmp/mma_rows > "$OUT/lab.txt" 2>&1
  grep -E "n=|us per|FAIL|passed|launch failure" "$OUT/lab.txt" | grep -v " 0 rows over"
  for i in ${LAB_NCU_SHAPES:-0 1 2 3 4}; do
    echo "== shape $i"
    LAB_SHAPE=$i ncu --clock-control none --csv --metrics gpu__time_duration.sum \
      -k regex:'q4_matvec_rows_kernel|lab_read' /tmp/mma_rows > "/tmp/ncu$i.csv" 2>&1
    python3 bench/tools/ncu_durations.py "/tmp/ncu$i.csv" \
      | sed 's/void routemm::cuda::q4_matvec_rows_kernel//; s/void lab_read_kernel/read floor/'
  done 2>&1 | tee "$OUT/ncu_durations.txt"
  for skip in 0 45; do
    LAB_SHAPE=0 ncu --clock-control none -k regex:q4_matvec_rows_kernel --launch-skip $skip --launch-count 1 \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
      /tmp/mma_rows 2>&1 | grep -vE " 0$|\(!\)" | grep -E "rows_kernel|stalled|inst_executed|issue_active|hmma|bank" \
      | awk '$NF+0 >= 0.05 || /kernel|inst|issue|hmma|bank/'
  done 2>&1 | tee "$OUT/ncu_stalls.txt"
  nvcc -std=c++20 -arch=sm_90a -O3 -Icsrc/backend/cuda -o /tmp/read_floor bench/lab/read_floor_lab.cu \
    && /tmp/read_floor 2>&1 | tee "$OUT/read_floor.txt"
  for mb in 4 8 16 25.2 33 64 128 256 512; do
    READ_FLOOR_MB=$mb ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:read_kernel \
      /tmp/read_floor > /tmp/ncu_rf.csv 2>&1
    echo "$mb MB: $(python3 bench/tools/ncu_durations.py /tmp/ncu_rf.csv | sed 's/void lab_read_kernel//' | tr '\n' ' ')"
  done 2>&1 | tee -a "$OUT/read_floor.txt"
}

cmd_lab() {
  case "${1:-}" in
    mma-rows) lab_mma_rows ;;
    *) echo "lab needs one of: mma-rows" >&2; return 2 ;;
  esac
}

# ---- engine ---------------------------------------------------------------------------------------

cmd_engine() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  build_or_fail
  grep -E " error|Error" "$OUT/build.log" 2>/dev/null | head -5

  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stamp pytest
    ROUTEMM_TEST_BACKENDS=cpu,cuda timeout 400 python3 -m pytest -q -p no:cacheprovider \
      tests/python/test_engine.py tests/python/test_torch_ops.py tests/python/test_torch_kernels.py \
      tests/python/test_encoder.py tests/python/test_matmul_id.py > "$OUT/pytest.log" 2>&1
    echo "pytest exit: $?" >> "$OUT/pytest.log"
    tail -15 "$OUT/pytest.log"
    stamp ctest
    cmake -S . -B /tmp/ctest -G Ninja -DROUTEMM_BUILD_TESTS=ON -DROUTEMM_BUILD_PYTHON=OFF \
      -DROUTEMM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a > /tmp/ctest-config.log 2>&1 &&
      cmake --build /tmp/ctest -j16 > /tmp/ctest-build.log 2>&1 &&
      ctest --test-dir /tmp/ctest -R "Encoder|Capture|AutoBarrier|CapturedGraph" >> "$OUT/pytest.log" 2>&1
    echo "ctest exit: $?" >> "$OUT/pytest.log"
    tail -4 "$OUT/pytest.log"
  fi

  if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
    stamp compute-sanitizer
    ROUTEMM_TEST_BACKENDS=cuda timeout 400 compute-sanitizer --tool memcheck --error-exitcode 3 \
      python3 -m pytest -q -p no:cacheprovider tests/python/test_torch_ops.py tests/python/test_engine.py \
      > "$OUT/sanitizer.log" 2>&1
    echo "sanitizer exit: $?" >> "$OUT/sanitizer.log"
    tail -6 "$OUT/sanitizer.log"
  fi

  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    stamp bench
    {
      python3 bench/engine_decode.py host-cost "$OUT/engine_host_cost-${CARD}.json"
      python3 bench/engine_decode.py decode-graph "$OUT/engine_decode_graph-${CARD}.json" \
        --layers "${LAYERS:-48}"
    } > "$OUT/bench.log" 2>&1
    echo "bench exit: $?" >> "$OUT/bench.log"
    cat "$OUT/bench.log"
  fi
  stamp done
}

# ---- host-cost ------------------------------------------------------------------------------------

cmd_host_cost() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export ROUTEMM_TORCH_OPS=ON  # the build fails unless the C++ kernels build against this torch
  build_or_fail
  grep -E "routemm torch ops" "$OUT/build.log" | head -2
  stamp bench
  local args=(--calls "${CALLS:-200}" --batches "${BATCHES:-15}")
  {
    (cd /tmp && python3 -c "import routemm.torch as t; print('kernels:', t.KERNELS, '-', t.KERNELS_REASON)")
    ROUTEMM_TORCH_KERNELS=cpp python3 bench/engine_decode.py host-cost "$OUT/engine_host_cost-${CARD}.json" "${args[@]}"
    echo "cpp kernels exit: $?"
    ROUTEMM_TORCH_KERNELS=python python3 bench/engine_decode.py host-cost \
      "$OUT/engine_host_cost_python-${CARD}.json" "${args[@]}"
    echo "python kernels exit: $?"
  } > "$OUT/bench.log" 2>&1
  cat "$OUT/bench.log"
  stamp done
}

# ---- block ----------------------------------------------------------------------------------------

cmd_block() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export ROUTEMM_TORCH_OPS=ON
  build_or_fail
  grep -E "routemm torch ops| error" "$OUT/build.log" | head -5
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stamp pytest
    ROUTEMM_TEST_BACKENDS=cpu,cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
      tests/python/test_torch_moe_experts_fused.py tests/python/test_torch_moe_experts.py \
      tests/python/test_torch_moe_batch_invariant.py tests/python/test_ggml_format_kernels_cuda.py \
      tests/python/test_transformers_experts.py > "$OUT/pytest.log" 2>&1
    echo "pytest exit: $?" >> "$OUT/pytest.log"
    tail -15 "$OUT/pytest.log"
  fi
  if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
    stamp compute-sanitizer
    ROUTEMM_TEST_BACKENDS=cuda timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
      python3 -m pytest -q -p no:cacheprovider tests/python/test_torch_moe_experts_fused.py \
      -k "not two_launches" > "$OUT/sanitizer.log" 2>&1  # its profiler cannot attach under the tool
    echo "sanitizer exit: $?" >> "$OUT/sanitizer.log"
    tail -6 "$OUT/sanitizer.log"
  fi
  stamp transformers-block
  python3 bench/tools/transformers_block.py --out "$OUT" --calls "${CALLS:-20}" \
    ${MODELS:+--models "$MODELS"} 2>&1 | tail -45
  if [ "${MODEL:-1}" != 0 ]; then
    stamp transformers-model
    python3 bench/tools/transformers_model.py --out "$OUT" --decode "${DECODE:-32}" 2>&1 | tail -25
  fi
  stamp done
}

# ---- direct-path ----------------------------------------------------------------------------------

cmd_direct_path() {
  export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  local work tool round path
  work=$(mktemp -d /tmp/direct.XXXXXX)
  build_or_fail
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stamp pytest
    ROUTEMM_TEST_BACKENDS=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
      tests/python/test_cuda_direct_data_path.py tests/python/test_quantized_matmul_id.py \
      > "$work/pytest.log" 2>&1
    echo "pytest exit: $?" >> "$work/pytest.log"
    tail -4 "$work/pytest.log"
  fi
  if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      stamp "compute-sanitizer $tool"
      ROUTEMM_TEST_BACKENDS=cuda timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        python3 -m pytest -q -p no:cacheprovider -x tests/python/test_quantized_matmul_id.py \
        -k direct >> "$work/sanitizer.log" 2>&1
      echo "$tool exit: $?" >> "$work/sanitizer.log"
    done
    grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|exit:" "$work/sanitizer.log" | tail -8
  fi
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for path in loads bulk; do
      stamp "qid timing, $path, round $round"
      mkdir -p "$work/qid-$path-$round"
      ROUTEMM_CUDA_DIRECT_PATH=$path timeout 90 python3 bench/tools/qid_timing.py \
        --out "$work/qid-$path-$round" --ms "${MS:-1,8}" --modes matmul --budget-s 60 \
        > "$work/qid-$path-$round/qid.jsonl" 2>&1
      grep -E "direct \| routemm" "$work/qid-$path-$round"/quantized_matmul_id-*.md | cut -d'|' -f3-8
    done
  done
  tar -C "$work" -czf "$OUT/direct_path.tar.gz" .
  stamp done
}

# ---- ab -------------------------------------------------------------------------------------------

cmd_ab() {
  [ $# -eq 2 ] || { echo "ab needs PATCH CMD" >&2; return 2; }
  local line=$2 rounds=${ROUNDS:-2} n=0 r i label=""
  local -a patches states
  IFS=: read -r -a patches <<< "$1"
  # Every change must be reversible in turn, last first, from the tree as it is.
  for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
    patch -R -p1 --dry-run -s < "${patches[i]}" > /dev/null 2>&1 || {
      echo "ab: ${patches[i]} is not applied to this tree" >&2
      for ((i = i + 1; i < ${#patches[@]}; i++)); do patch -p1 -s < "${patches[i]}"; done
      return 2
    }
    [ "$i" -gt 0 ] && patch -R -p1 -s < "${patches[i]}"
  done
  for ((i = 1; i < ${#patches[@]}; i++)); do patch -p1 -s < "${patches[i]}"; done
  # State s runs with patches[0 .. n-1-s] applied.
  states=(with)
  if [ ${#patches[@]} -eq 1 ]; then
    states+=(without)
  else
    for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
      label="$label-$(basename "${patches[i]}" .diff)"
      states+=("without$label")
    done
  fi
  mkdir -p /tmp/ab
  for r in $(seq 1 "$rounds"); do
    for ((i = 0; i < ${#states[@]}; i++)); do
      n=$((n + 1))
      [ "$i" -gt 0 ] && patch -R -p1 -s < "${patches[${#patches[@]} - i]}"
      stamp "ab $n: build (${states[i]})"
      if ! build_sm90a "/tmp/ab/build-$n.log"; then
        tail -30 "/tmp/ab/build-$n.log"
        for ((; i > 0; i--)); do patch -p1 -s < "${patches[${#patches[@]} - i]}"; done
        return 1
      fi
      stamp "ab $n: run (${states[i]})"
      mkdir -p "/tmp/ab/$n-${states[i]}"
      AB_OUT=/tmp/ab/$n-${states[i]} bash -c "$line" > "$OUT/ab-$n-${states[i]}.log" 2>&1
      echo "exit: $?" >> "$OUT/ab-$n-${states[i]}.log"
      tail -n "${AB_TAIL:-12}" "$OUT/ab-$n-${states[i]}.log"
    done
    for ((i = ${#states[@]} - 1; i > 0; i--)); do patch -p1 -s < "${patches[${#patches[@]} - i]}"; done
  done
  tar -C /tmp --exclude='build-*' -czf "$OUT/ab.tar.gz" ab
  stamp done
}

# ---- batch ----------------------------------------------------------------------------------------

cmd_batch() {
  local spec name knobs left n=0 final=$OUT root
  [ $# -gt 0 ] || { echo "batch needs at least one command" >&2; return 2; }
  root=$(mktemp -d /tmp/batch.XXXXXX)  # each command's folder, packed from here
  for spec in "$@"; do
    name=${spec%%:*}
    knobs=""
    [ "$spec" != "$name" ] && knobs=${spec#*:}
    left=$(( ${BATCH_UNTIL_S:-570} - $(elapsed) ))
    if [ "$left" -lt 20 ]; then
      stamp "batch: $name not run, ${left} s left"
      continue
    fi
    mkdir -p "$root/$name"
    stamp "batch: $name${knobs:+ ($knobs)}, ${left} s left"
    (
      [ "$n" -gt 0 ] && export SKIP_BUILD=1
      for kv in $knobs; do export "${kv?}"; done
      OUT=$root/$name timeout -s INT -k 10 "$left" bash bench/device.sh "$name"
    ) > "$root/$name/console.txt" 2>&1
    echo "exit: $?" >> "$root/$name/console.txt"
    tail -n "${BATCH_TAIL:-30}" "$root/$name/console.txt"
    tar -C "$root" -czf "$final/$name.tar.gz" "$name"
    n=$((n + 1))
  done
  stamp done
}

# ---- dispatch -------------------------------------------------------------------------------------

command=${1:-help}
[ $# -gt 0 ] && shift
case "$command" in
  help | -h | --help) usage; exit 0 ;;
  suite | session | quick | demo | q4-matvec | tensor | profile | peer | qid | engine | host-cost | lab \
    | direct-path | ab | batch | block) ;;
  *) echo "unknown command '$command'" >&2; usage >&2; exit 2 ;;
esac
source bench/device_common.sh
"cmd_${command//-/_}" "$@"
