"""The tensor-core expert-ID routes timed per kernel (map, conversion, tensor kernel) from the
PyTorch profiler's CUDA trace, beside torch._grouped_mm, on the MoE shapes of
bench/bench_cuda_dense_matmul_id.py (bf16 weights, router-like IDs, weight copies rotated past L2).

    python3 bench/tools/tensor_timing.py qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 512,4096
"""

import math
import os
import sys

import routemm
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_cuda_dense_matmul_id as B  # noqa: E402

ROUTES = ("grouped_tensor_lowp", "grouped_tensor_tf32")


def kernel_split(fn, n: int) -> tuple[float, dict]:
    """(seconds per call, {map, convert, tensor, other: seconds per call}) over n calls."""
    events = B.gpu_events(fn, n)
    split: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            name = e["name"]
            if "map_count" in name or "map_scatter" in name:
                key = "map"
            elif "round_activation" in name:
                key = "convert"
            elif "grouped_tensor" in name or "grouped_wgmma" in name:
                key = "tensor"
            else:
                key = "other"
            split[key] = split.get(key, 0) + e["dur"] / 1e6 / n
    return sum(split.values()), split


def time_shape(dev, reg, name: str, ms: list[int]) -> None:
    c = B.SHAPES[name]
    experts, top_k, n, k = c["E"], c["top_k"], c["n"], c["k"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    copies = max(1, math.ceil(400e6 / (experts * n * k * 2)))
    stacks = [
        (torch.randn((experts, n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)
    ]
    wb = [B.to_routemm(s, dev) for s in stacks]
    for m in ms:
        x = torch.randn((m, k), device="cuda", generator=gen)
        xb = B.to_routemm(x, dev)
        ids = [B.router_ids(gen, m, experts, top_k) for _ in range(4)]
        ib = [B.to_routemm(i, dev) for i in ids]
        out = torch.empty((m * top_k, n), device="cuda")
        ob = B.to_routemm(out, dev)
        scratch = routemm.DenseMatmulIdScratch(dev, experts, m)
        flops = 2 * m * top_k * n * k
        for route in ROUTES:
            params = routemm.DenseMatmulIdParams(
                m, n, k, top_k, experts, n * k * 2, route=routemm.DenseMatmulIdRoute(route)
            )

            def call(j, params=params):
                enc = dev.command_encoder()
                routemm.dense_matmul_id(enc, reg, wb[j % copies], xb, ib[j % 4], ob, scratch, params)
                enc.commit_and_wait()

            call(0)
            rows = torch.arange(0, m * top_k, max(1, m * top_k // 64), device="cuda")[:64]
            want = torch.einsum("snk,sk->sn", stacks[0][ids[0].reshape(-1).long()[rows]].float(), x[rows // top_k])
            err = float((out[rows] - want).norm() / want.norm())
            t, split = kernel_split(call, 10)
            tt = split.get("tensor", float("nan"))
            print(
                f"{name:14s} m={m:5d} {route:20s} {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOP/s | tensor kernel "
                f"{tt * 1e6:8.1f} us {flops / tt / 1e12:7.1f} TFLOP/s, map {split.get('map', 0) * 1e6:7.1f} us, "
                f"convert {split.get('convert', 0) * 1e6:6.1f} us | err {err:.1e}",
                flush=True,
            )

        def grouped_mm(i):
            w = stacks[i % copies]
            flat = ids[i % 4].reshape(-1)
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=experts), 0).to(torch.int32)
            r = torch._grouped_mm(x[order // top_k].to(torch.bfloat16), w.transpose(-2, -1), offs=offs)
            o2 = torch.empty((m * top_k, n), device="cuda")
            o2[order] = r.float()
            return o2

        t = B.kernel_time(grouped_mm, 10)
        print(
            f"{name:14s} m={m:5d} {'torch_grouped_mm':20s} {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOP/s",
            flush=True,
        )


if __name__ == "__main__":
    device = routemm.Device("cuda")
    registry = routemm.KernelRegistry(device)
    for shape in sys.argv[1].split(","):
        time_shape(device, registry, shape, [int(v) for v in sys.argv[2].split(",")])
        torch.cuda.empty_cache()  # the shape's weight copies are gone with time_shape's frame
