"""Small CUDA cases for compute-sanitizer (memcheck, racecheck): odd tails of every route.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/tools/cuda_checks.py

Expert-ID: `direct` and `grouped_prefill` bit-identical on odd shapes, invalid IDs included (one case
with 680 grouped tiles). Q4_0: every pipeline on odd tails, an unaligned weight view (byte copies),
K splits (clusters; the 4352 cases have empty splits) and, on Hopper, the bf16 routes' wgmma kernel
(k % 256 == 0, aligned; 14336: every warp ring of the mat-vec wraps).
"""

import ml_dtypes
import numpy as np
import routemm
from q4_profile import run_q4  # bench/tools/, the script's folder
from routemm import q4_0

EXPERT_ID_CASES = [  # (weight dtype, k, n, m, top_k, experts)
    (np.float32, 35, 7, 9, 6, 8),
    (ml_dtypes.bfloat16, 64, 40, 33, 4, 16),
    (np.float16, 2048, 96, 5, 8, 32),
    (np.float32, 72, 1030, 130, 8, 8),
    (ml_dtypes.bfloat16, 72, 1030, 130, 8, 8),  # 680 grouped tiles
]
Q4_CASES = [  # (m, n, k, byte offset of the weight view)
    (3, 200, 4096, 0),
    (40, 130, 800, 1),
    (130, 70, 2048, 0),
    (9, 33, 64, 2),
    (20, 40, 4352, 0),
    (150, 136, 512, 0),
    (8, 200, 4352, 0),
    (1, 130, 14336, 0),
    (5, 70, 2048, 2),
]


def expert_id_cases(dev, rng) -> None:
    for dt, k, n, m, top_k, experts in EXPERT_ID_CASES:
        w = rng.standard_normal((experts, n, k)).astype(dt)
        x = rng.standard_normal((m, k)).astype(np.float32)
        ids = np.argsort(rng.random((m, experts)), 1)[:, :top_k].astype(np.uint32)
        ids[0, 0] = 0xFFFFFFFF
        ids[-1, -1] = experts
        outs = {route: routemm.matmul_id(w, x, ids, route=route, device=dev) for route in ("direct", "grouped_prefill")}
        assert np.array_equal(outs["direct"].view(np.uint32), outs["grouped_prefill"].view(np.uint32)), dt
        print("ok", np.dtype(dt).name, k, n, m, top_k, experts)


def q4_cases(dev, reg, rng) -> None:
    for m, n, k, offset in Q4_CASES:
        w = q4_0.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32)).reshape(-1)
        raw = np.zeros(w.size + offset, np.uint8)
        raw[offset:] = w
        wbuf = dev.from_numpy(raw).view(offset, w.size, routemm.DType.U8, [w.size])
        x = dev.from_numpy(rng.uniform(-1, 1, (m, k)).astype(np.float32))
        p = routemm.GgmlQuantizedMatmulParams(m, n, k)
        for route in [None] + (list(routemm.DenseQ4Route) if m > 8 else []):
            out = dev.from_numpy(np.zeros((m, n), np.float32))
            r = run_q4(dev, reg, x, wbuf, out, p, route)
            print("ok q4", m, n, k, offset, r.route, r.dispatch.grid)


if __name__ == "__main__":
    device = routemm.Device("cuda")
    generator = np.random.default_rng(0)
    expert_id_cases(device, generator)
    q4_cases(device, routemm.KernelRegistry(device), generator)
