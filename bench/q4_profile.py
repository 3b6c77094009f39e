"""One launch each of the Q4_0 mat-vec (m=1, 8) and the V2 / 64x32 routes (m=512, m=4096) on 4096 x 14336,
for Nsight Compute:  ncu --clock-control none -k regex:q4_kernel --section SpeedOfLight \
--section WarpStateStats python3 bench/q4_profile.py  (each case runs twice: warm-up, then the
profiled launch)."""

import numpy as np
import routemm
from routemm import q4_0

dev = routemm.Device("cuda")
reg = routemm.KernelRegistry(dev)
rng = np.random.default_rng(0)
n, k = 4096, 14336
w = dev.from_numpy(q4_0.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32)).reshape(-1))
for m, route in [
    (1, None),
    (8, None),
    (512, routemm.DenseQ4Route.COMPATIBILITY_V2),
    (512, routemm.DenseQ4Route.TENSOR_64X32),
    (4096, routemm.DenseQ4Route.COMPATIBILITY_V2),
]:
    x = dev.from_numpy(rng.uniform(-1, 1, (m, k)).astype(np.float32))
    out = dev.from_numpy(np.zeros((m, n), np.float32))
    p = routemm.GgmlQuantizedMatmulParams(m, n, k)
    for _ in range(2):
        enc = dev.command_encoder()
        if route is None:
            r = routemm.quantized_matmul_ggml(enc, reg, x, w, out, p, routemm.GgmlRoutingPolicy())
        else:
            r = routemm.encode_q4_route(enc, reg, x, w, out, p, route)
        enc.commit_and_wait()
    print(m, r.route, r.dispatch.grid, r.dispatch.threads_per_threadgroup, r.dispatch.threadgroup_memory, flush=True)
