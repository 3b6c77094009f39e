"""Huge-page CPU buffers against 4 KiB pages, in one process: the same Qwen3-30B-A3B expert stack
(128 x 768 x 2048) in a routemm buffer (2 MiB aligned, MADV_HUGEPAGE unless
ROUTEMM_CPU_HUGE_PAGES=0) and in a torch allocation (4 KiB pages where transparent huge pages are
given only on request) wrapped by routemm.from_dlpack; m = 1 direct routes, four dispatches per
submission, the two buffers alternating over ROUNDS rounds. Prints each round's minimum per
dispatch and the medians.

    python bench/lab/cpu_huge_pages_ab.py [ROUNDS]
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np
import routemm
import torch

E, EN, EK, TOP_K = 128, 768, 2048, 8


def anon_huge_pages() -> str:
    with open("/proc/self/smaps_rollup") as f:
        return next(line.strip() for line in f if line.startswith("AnonHugePages"))


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    dev = routemm.Device("cpu")
    reg = routemm.KernelRegistry(dev)
    route = routemm.DenseMatmulIdRoute
    rng = np.random.default_rng(1)
    cases = (
        ("bf16", ml_dtypes.bfloat16, (route.DIRECT, route.DIRECT_BF16_DOT)),
        ("f32", np.float32, (route.DIRECT,)),
    )
    times: dict[tuple[str, str, str], list[float]] = {}
    for name, dtype, routes in cases:
        w = (rng.standard_normal((E, EN, EK), dtype=np.float32) * 0.02).astype(dtype)
        huge = dev.from_numpy(w)
        src = torch.from_numpy(w.view(np.uint16)).view(torch.bfloat16) if name == "bf16" else torch.from_numpy(w)
        plain_tensor = torch.empty(src.shape, dtype=src.dtype)
        plain_tensor.copy_(src)
        plain = routemm.from_dlpack(plain_tensor)
        print(name, "stack", w.nbytes >> 20, "MB;", anon_huge_pages(), flush=True)
        stride = EN * EK * w.itemsize
        x = dev.from_numpy(rng.standard_normal((1, EK), dtype=np.float32))
        out = dev.alloc(TOP_K * EN * 4, routemm.DType.F32, [TOP_K, EN])
        ids = [dev.from_numpy(np.argsort(rng.random((1, E)))[:, :TOP_K].astype(np.uint32)) for _ in range(64)]
        for r in routes:
            params = routemm.DenseMatmulIdParams(1, EN, EK, TOP_K, E, stride, route=r)
            for rnd in range(rounds):
                order = (("huge", huge), ("4k", plain)) if rnd % 2 == 0 else (("4k", plain), ("huge", huge))
                for label, buf in order:
                    best = float("inf")
                    for i in range(12):
                        enc = dev.command_encoder()
                        for j in range(4):
                            one = ids[(4 * i + j + 16 * rnd) % len(ids)]
                            routemm.dense_matmul_id(enc, reg, buf, x, one, out, None, params)
                        t = time.perf_counter()
                        enc.commit_and_wait()
                        best = min(best, (time.perf_counter() - t) / 4)
                    times.setdefault((name, r.value, label), []).append(best * 1e6)
    for key, values in times.items():
        print(key, [round(v) for v in values], "median", round(float(np.median(values))))


if __name__ == "__main__":
    main()
