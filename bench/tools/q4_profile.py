"""Launches of the Q4_0 routes on 4096 x 14336, for Nsight Compute. Cases from the command line as
m:route (route: mv = the default mat-vec path, simd, v1, v2, 64x32), default: 1:mv 8:mv 512:v2
512:64x32 4096:v2. Each case runs twice (warm-up, then the launch to profile), e.g.

    ncu --clock-control none -k regex:q4_wgmma --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 bench/tools/q4_profile.py 9:64x32
"""

import sys

import numpy as np
import routemm
from routemm import q4_0

ROUTES = {
    "mv": None,
    "simd": routemm.DenseQ4Route.COMPATIBILITY_SIMDGROUP,
    "v1": routemm.DenseQ4Route.COMPATIBILITY_TENSOR_V1,
    "v2": routemm.DenseQ4Route.COMPATIBILITY_V2,
    "64x32": routemm.DenseQ4Route.TENSOR_64X32,
}


def run_q4(dev, reg, x, w, out, params, route):
    """One submitted Q4_0 call: `route` None takes the default policy (the mat-vec path for m <= 8),
    else that route is forced; returns the receipt."""
    enc = dev.command_encoder()
    if route is None:
        receipt = routemm.quantized_matmul_ggml(enc, reg, x, w, out, params, routemm.GgmlRoutingPolicy())
    else:
        receipt = routemm.encode_q4_route(enc, reg, x, w, out, params, route)
    enc.commit_and_wait()
    return receipt


def main(cases: list[str]) -> None:
    dev = routemm.Device("cuda")
    reg = routemm.KernelRegistry(dev)
    rng = np.random.default_rng(0)
    n, k = 4096, 14336
    w = dev.from_numpy(q4_0.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32)).reshape(-1))
    for case in cases:
        m_text, route_key = case.split(":")
        m, route = int(m_text), ROUTES[route_key]
        x = dev.from_numpy(rng.uniform(-1, 1, (m, k)).astype(np.float32))
        out = dev.from_numpy(np.zeros((m, n), np.float32))
        p = routemm.GgmlQuantizedMatmulParams(m, n, k)
        for _ in range(2):
            r = run_q4(dev, reg, x, w, out, p, route)
        print(
            m, r.route, r.dispatch.grid, r.dispatch.threads_per_threadgroup, r.dispatch.threadgroup_memory, flush=True
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["1:mv", "8:mv", "512:v2", "512:64x32", "4096:v2"])
