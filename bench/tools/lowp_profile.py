"""One grouped_tensor_lowp call (bf16 weights, router-like ids) per named shape and m, for Nsight
Compute; each case runs twice (warm-up, then the launch to profile with --launch-skip):

    ncu --clock-control none -k regex:grouped_lowp --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 bench/tools/lowp_profile.py mixtral-8x7b:4096

Arguments: shape:m pairs (shapes of bench/bench_cuda_dense_matmul_id.py)."""

import sys

import routemm
import torch

SHAPES = {
    "qwen3-30b-a3b": dict(E=128, top_k=8, n=768, k=2048),
    "deepseek-v3": dict(E=256, top_k=8, n=2048, k=7168),
    "mixtral-8x7b": dict(E=8, top_k=2, n=14336, k=4096),
}

dev = routemm.Device("cuda")
reg = routemm.KernelRegistry(dev)
gen = torch.Generator(device="cuda")
gen.manual_seed(0)
for case in sys.argv[1:] or ["qwen3-30b-a3b:4096"]:
    name, m = case.split(":")
    m = int(m)
    c = SHAPES[name]
    E, top_k, n, k = c["E"], c["top_k"], c["n"], c["k"]
    w = (torch.randn((E, n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn((m, k), device="cuda", generator=gen)
    ids = torch.topk(torch.rand((m, E), device="cuda", generator=gen), top_k, dim=1).indices.to(torch.int32)
    out = torch.empty((m * top_k, n), device="cuda")
    scratch = routemm.DenseMatmulIdScratch(dev, E, m)
    params = routemm.DenseMatmulIdParams(
        m, n, k, top_k, E, n * k * 2, route=routemm.DenseMatmulIdRoute.GROUPED_TENSOR_LOWP
    )
    bufs = [routemm.from_dlpack(t) for t in (w, x, ids, out)]
    bufs[2] = bufs[2].view(0, bufs[2].nbytes, routemm.DType.U32, list(ids.shape))  # ids as U32
    for _ in range(2):
        enc = dev.command_encoder()
        routemm.dense_matmul_id(enc, reg, bufs[0], bufs[1], bufs[2], bufs[3], scratch, params)
        enc.commit_and_wait()
    print(case, "done", flush=True)
