"""Calibrates a frozen Q4_0 route plan on this device with real timings (no fixtures) for the
llama.cpp perf shape (n=4096, k=14336) and Qwen3-30B-A3B's q_proj (n=4096, k=2048), then prints
every decision (route, status, median wall/GPU time of V2 and 64x32) and writes the receipt JSON.

    python3 bench/q4_plan.py [receipt.json]
"""

import json
import sys
import time

import numpy as np
import routemm
from routemm import q4_0

dev = routemm.Device()
reg = routemm.KernelRegistry(dev)
rng = np.random.default_rng(0)
cases = []
for n, k, ms in [(4096, 14336, (9, 16, 32, 64, 128, 512, 2048)), (4096, 2048, (9, 32, 128, 512, 4096))]:
    w = dev.from_numpy(q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32)).reshape(-1))
    cases.append(routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, k), ms))
limits = routemm.DenseQ4CalibrationLimits(max_elapsed_ms=60000, max_shapes=256)
start = time.perf_counter()
plan, receipt = routemm.calibrate_dense_q4_routes(reg, dev, 1, limits, cases)
elapsed = time.perf_counter() - start
print(f"device {dev.name} ({dev.backend}); calibration {elapsed * 1e3:.0f} ms; plan {plan.plan_id[:16]}")
for d in receipt.decisions:
    times = {t.route.value: (round(t.wall.median_us, 1), round(t.gpu.median_us, 1)) for t in d.timings}
    print(
        f"n={d.shape.n:5d} k={d.shape.k:5d} m={d.shape.m:5d} -> {d.selected_route.value:16s} "
        f"{d.status.value:24s} wall/gpu us {times}"
    )
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(json.loads(receipt.to_json()), f, indent=1)
