#!/usr/bin/env bash
# On a CUDA machine, from the repo root: build with the CUDA backend, run the main job (the demo) at
# its default and full Qwen3-30B-A3B sizes, and time the expert-ID map dispatch alone (a grouped
# call whose matmul is negligible). Outputs land in $OUT.
set -u
OUT=${OUT:-/tmp/routemm-out}
mkdir -p "$OUT"
export ROUTEMM_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90a"
python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cd /tmp
python3 -m routemm demo | tee "$OUT/demo.txt"
python3 -m routemm demo --model qwen3-30b-a3b --tokens 512 --json > "$OUT/demo-qwen3-30b-a3b.json"
python3 -c "import json; r = json.load(open('$OUT/demo-qwen3-30b-a3b.json')); print('full qwen3 ok:', r['ok'], [(x['m'], x['route'], round(x['time_us'], 1)) for x in r['runs']])"
python3 - <<'PY' | tee "$OUT/map.txt"
import numpy as np, routemm
dev = routemm.Device("cuda"); reg = routemm.KernelRegistry(dev)
for E, top_k, m in [(128, 8, 512), (128, 8, 4096), (256, 8, 4096), (8, 2, 4096)]:
    n, k = 8, 32  # the grouped matmul is negligible: the time is the map's
    rng = np.random.default_rng(0)
    w = dev.from_numpy(np.zeros((E, n, k), np.float32)); x = dev.from_numpy(np.zeros((m, k), np.float32))
    ids = dev.from_numpy(np.argsort(rng.random((m, E)), 1)[:, :top_k].astype(np.uint32))
    out = dev.alloc(m * top_k * n * 4, routemm.DType.F32, [m * top_k, n])
    p = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * 4, route=routemm.DenseMatmulIdRoute.GROUPED_PREFILL)
    s = routemm.DenseMatmulIdScratch(dev, E, m)
    times = []
    for rep in range(6):
        enc = dev.command_encoder()
        for _ in range(20):
            routemm.dense_matmul_id(enc, reg, w, x, ids, out, s, p)
        a, b = enc.commit_wait_with_gpu_time()
        times.append((b - a) / 20 * 1e6)
    print(f"map+tiny grouped E={E} top_k={top_k} m={m}: {sorted(times)[3]:.1f} us per call")
PY
