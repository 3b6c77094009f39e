"""The expert-ID map dispatch timed alone on CUDA: a grouped_prefill call whose matmul is negligible
(n = 8, k = 32), 20 calls per submission, the median of 6 submissions' GPU time per call.

    python3 bench/tools/map_timing.py
"""

import numpy as np
import routemm

CASES = [(128, 8, 512), (128, 8, 4096), (256, 8, 4096), (8, 2, 4096)]  # (experts, top_k, m)
N, K = 8, 32  # the grouped matmul is negligible: the time is the map's
CALLS, SUBMISSIONS = 20, 6

dev = routemm.Device("cuda")
reg = routemm.KernelRegistry(dev)
for experts, top_k, m in CASES:
    rng = np.random.default_rng(0)
    w = dev.from_numpy(np.zeros((experts, N, K), np.float32))
    x = dev.from_numpy(np.zeros((m, K), np.float32))
    ids = dev.from_numpy(np.argsort(rng.random((m, experts)), 1)[:, :top_k].astype(np.uint32))
    out = dev.alloc(dtype=routemm.DType.F32, shape=[m * top_k, N])
    params = routemm.DenseMatmulIdParams(
        m, N, K, top_k, experts, N * K * 4, route=routemm.DenseMatmulIdRoute.GROUPED_PREFILL
    )
    scratch = routemm.DenseMatmulIdScratch(dev, experts, m)
    times = []
    for _ in range(SUBMISSIONS):
        enc = dev.command_encoder()
        for _ in range(CALLS):
            routemm.dense_matmul_id(enc, reg, w, x, ids, out, scratch, params)
        start, end = enc.commit_wait_with_gpu_time()
        times.append((end - start) / CALLS * 1e6)
    print(f"map+tiny grouped E={experts} top_k={top_k} m={m}: {sorted(times)[SUBMISSIONS // 2]:.1f} us per call")
