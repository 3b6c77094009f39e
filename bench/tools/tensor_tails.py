"""K and N tails of the tensor-core expert-ID routes on CUDA against a float64 reference.

    python3 bench/tools/tensor_tails.py [short]

Every weight dtype with grouped_tensor_tf32 (relative error <= 2e-3) and f16/bf16 with
grouped_tensor_lowp (<= 1e-2), an invalid ID in each case; `short` runs the first two shapes only
(for compute-sanitizer). Prints one line per case and `tails bad: N`.
"""

import sys

import ml_dtypes
import numpy as np
import routemm

CASES = [(100, 130, 72, 2, 4), (300, 136, 72, 4, 4), (700, 200, 264, 8, 16), (33, 7, 35, 6, 8), (64, 129, 40, 2, 8)]
DTYPES = [(np.float32, routemm.DType.F32), (np.float16, routemm.DType.F16), (ml_dtypes.bfloat16, routemm.DType.BF16)]
TOLERANCE = {"grouped_tensor_tf32": 2e-3, "grouped_tensor_lowp": 1e-2}


def check(dev, reg, rng, m, n, k, top_k, experts, dt, rd, route) -> bool:
    w = (rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(dt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = np.argsort(rng.random((m, experts)), 1)[:, :top_k].astype(np.uint32)
    ids[0, 0] = 0xFFFFFFFF
    params = routemm.DenseMatmulIdParams(
        m, n, k, top_k, experts, n * k * np.dtype(dt).itemsize, route=routemm.DenseMatmulIdRoute(route)
    )
    wb = dev.from_numpy(w.view(np.uint16), rd) if dt is not np.float32 else dev.from_numpy(w)
    out = dev.from_numpy(np.full((m * top_k, n), np.nan, np.float32))
    scratch = routemm.DenseMatmulIdScratch(dev, experts, m)
    enc = dev.command_encoder()
    routemm.dense_matmul_id(enc, reg, wb, dev.from_numpy(x), dev.from_numpy(ids), out, scratch, params)
    enc.commit_and_wait()
    got = out.numpy()
    ref = np.zeros_like(got, dtype=np.float64)
    for row, expert in enumerate(ids.reshape(-1)):
        if expert < experts:
            ref[row] = w[expert].astype(np.float64) @ x[row // top_k].astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    ok = bool(np.isfinite(got).all() and err <= TOLERANCE[route])
    print("OK " if ok else "BAD", m, n, k, top_k, experts, np.dtype(dt).name, route, f"{err:.2e}")
    return ok


def main(argv: list[str]) -> int:
    dev = routemm.Device("cuda")
    reg = routemm.KernelRegistry(dev)
    rng = np.random.default_rng(1)
    bad = 0
    for m, n, k, top_k, experts in CASES[:2] if argv else CASES:
        for dt, rd in DTYPES:
            for route in TOLERANCE:
                if route.endswith("lowp") and dt is np.float32:
                    continue
                bad += not check(dev, reg, rng, m, n, k, top_k, experts, dt, rd, route)
    print("tails bad:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
