"""The CPU pool's polling beside another framework's threads: two live processes (the default
polling and ROUTEMM_CPU_SPIN_US=0) take turns timing a loop of a routemm Q4_0 mat-vec (2048 x
2048, one token) followed by three torch CPU matmuls (64 x 1024 @ 1024 x 1024, torch's own
threads), each alone as well; per iteration, the fastest of 5 x 50 iterations, medians of ROUNDS.

    python bench/lab/cpu_spin_torch_mix.py [ROUNDS]
"""

import json
import statistics
import sys
import time

import numpy as np


def child():
    import routemm
    import torch
    from routemm import q4_0

    dev = routemm.Device("cpu")
    reg = routemm.KernelRegistry(dev)
    rng = np.random.default_rng(0)
    n, k = 2048, 2048
    w = dev.from_numpy(q4_0.quantize(rng.standard_normal((n, k), dtype=np.float32)))
    x = dev.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    out = dev.alloc(n * 4, routemm.DType.F32, [1, n])
    p = routemm.GgmlQuantizedMatmulParams(1, n, k)
    pol = routemm.GgmlRoutingPolicy()
    a = torch.randn(64, 1024)
    b = torch.randn(1024, 1024)
    print("ready", torch.get_num_threads(), flush=True)
    for _ in sys.stdin:
        res = {}
        for mode in ("routemm+torch", "torch only", "routemm only"):
            best = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(50):
                    if mode != "torch only":
                        enc = dev.command_encoder()
                        routemm.quantized_matmul_ggml(enc, reg, x, w, out, p, pol)
                        enc.commit_and_wait()
                    if mode != "routemm only":
                        for _ in range(3):
                            a @ b
                best.append((time.perf_counter() - t0) / 50 * 1e6)
            res[mode] = min(best)
        print(json.dumps(res), flush=True)


def main():
    from cpu_spin_ab import take_turns  # beside this file

    def show_ready(lines):
        for line in lines:
            print(line)

    res = take_turns(__file__, int(sys.argv[1]) if len(sys.argv) > 1 else 6, show_ready)
    for mode in res["polling"][0]:
        s = statistics.median(r[mode] for r in res["sleeping"])
        q = statistics.median(r[mode] for r in res["polling"])
        print(f"{mode:15s} sleep {s:7.1f} us  poll {q:7.1f} us  ({(s / q - 1) * 100:+.1f}% speed with polling)")


child() if sys.argv[1:] == ["--child"] else main()
