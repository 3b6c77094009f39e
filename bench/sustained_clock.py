"""Does sustained load slow the tensor routes? The same grouped_tensor_lowp call timed by CUPTI
(bench_cuda_dense_matmul_id.kernel_time, as the bench does) after the GPU idled, and right after
seconds of back-to-back calls, with the SM clock, power and throttle reasons nvidia-smi reports while
the calls run. The bench times its routemm cases after batches sized to TARGET_S of device time;
the per-kernel harness (`bench/device.sh tensor`) times a 10-call burst.

    python3 bench/sustained_clock.py [SHAPE] [M] [SECONDS]    (default qwen3-30b-a3b 4096 3)
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import routemm
import torch

sys.path.insert(0, "bench")
import bench_cuda_dense_matmul_id as B  # noqa: E402

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def smi() -> str:
    run = subprocess.run(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    return run.stdout.strip() or run.stderr.strip()[:80]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    c = B.SHAPES[name]
    E, top_k, n, k = c["E"], c["top_k"], c["n"], c["k"]
    dev = routemm.Device("cuda")
    reg = routemm.KernelRegistry(dev)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    copies = max(1, math.ceil(400e6 / (E * n * k * 2)))
    stacks = [(torch.randn((E, n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    wb = [B.to_routemm(s, dev) for s in stacks]
    xb = B.to_routemm(torch.randn((m, k), device="cuda", generator=gen), dev)
    ib = [B.to_routemm(B.router_ids(gen, m, E, top_k), dev) for _ in range(4)]
    ob = B.to_routemm(torch.empty((m * top_k, n), device="cuda"), dev)
    sc = routemm.DenseMatmulIdScratch(dev, E, m)
    params = routemm.DenseMatmulIdParams(
        m, n, k, top_k, E, n * k * 2, route=routemm.DenseMatmulIdRoute.GROUPED_TENSOR_LOWP
    )

    def call(j: int) -> None:
        enc = dev.command_encoder()
        routemm.dense_matmul_id(enc, reg, wb[j % copies], xb, ib[j % 4], ob, sc, params)
        enc.commit_and_wait()

    def batch(calls: int) -> float:
        """`calls` calls back to back into one encoder; GPU time per call (s) from its events."""
        enc = dev.command_encoder()
        for j in range(calls):
            routemm.dense_matmul_id(enc, reg, wb[j % copies], xb, ib[j % 4], ob, sc, params)
        g = enc.commit_wait_with_gpu_time()
        return (g[1] - g[0]) / calls

    call(0)
    per_call = batch(20)
    flops = 2 * m * top_k * n * k
    print(f"{name} m={m} grouped_tensor_lowp, {copies} weight copies, ~{per_call * 1e6:.0f} us per call", flush=True)
    for phase in ("after idle", "after sustained load", "after idle again"):
        if phase == "after sustained load":
            readings = []
            stop = time.perf_counter() + seconds
            sampler = threading.Thread(target=lambda: (time.sleep(seconds / 2), readings.append(smi())))
            sampler.start()
            while time.perf_counter() < stop:
                batch(max(1, int(0.05 / per_call)))
            sampler.join()
            print(f"  during {seconds:.0f} s of load: {readings[0]}", flush=True)
        else:
            time.sleep(5.0)
            print(f"  idle: {smi()}", flush=True)
        ev = batch(20)
        print(f"  {phase:22s}: {ev * 1e6:8.1f} us  {flops / ev / 1e12:6.1f} TFLOP/s (events, 20 calls)", flush=True)
        t = B.kernel_time(call, 10)
        print(f"  {phase:22s}: {t * 1e6:8.1f} us  {flops / t / 1e12:6.1f} TFLOP/s (CUPTI, 10 calls)", flush=True)


if __name__ == "__main__":
    main()
