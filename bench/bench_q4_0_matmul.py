"""CPU benchmarks of the GGML Q4_0 dense projection on a 4096 x 14336 weight (N x K, the Llama/
Mistral FFN down projection shape).

routemm at decode widths m = 1 and 8 (the mat-vec pipeline, memory-bound: GB/s of Q4_0 blocks
streamed) and m = 64 (the compatibility_v2 matrix route: GFLOP/s), beside NumPy's formulation of the
same product (dequantise the blocks to float32, then a BLAS matmul) in the same run. Short on
purpose: the bench machine is shared.

    python -m pytest bench/bench_q4_0_matmul.py --benchmark-only --results bench/results/q4_0_matmul-cpu.json
"""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import q4_0

N, K = 4096, 14336
SHAPE = f"{N}x{K}"
WEIGHT_BYTES = N * K // 32 * 18
ROUNDS = {1: 10, 8: 6, 64: 3}


@pytest.fixture(scope="module")
def weight(device):
    rng = np.random.default_rng(0)
    blocks = q4_0.quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.02)
    return blocks, device.from_numpy(blocks)


def _numpy_dequantize(blocks: np.ndarray) -> np.ndarray:
    """Vectorised NumPy dequantisation of [n, k/32*18] Q4_0 bytes to float32 [n, k]."""
    raw = blocks.reshape(blocks.shape[0], -1, 18)
    d = raw[..., :2].copy().view(np.float16).astype(np.float32)  # [n, blocks, 1]
    qs = raw[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - np.int8(8)
    return (q * d).reshape(blocks.shape[0], -1)


def _numpy_formulation(blocks, x):
    return x @ _numpy_dequantize(blocks).T


def _record(results, benchmark, *, m, route, impl, note=""):
    seconds = benchmark.stats.stats.median
    flops = 2 * m * N * K
    results.add(
        op="q4_0_matmul",
        shape=SHAPE,
        m=m,
        weight_dtype="q4_0",
        route=route,
        impl=impl,
        time_us=seconds * 1e6,
        bytes=WEIGHT_BYTES,
        flops=flops,
        TBps=WEIGHT_BYTES / seconds / 1e12,
        TFLOPs=flops / seconds / 1e12,
        note=note,
    )


@pytest.mark.parametrize("m", sorted(ROUNDS))
def test_routemm(benchmark, results, device, registry, weight, m):
    blocks, w_buf = weight
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, K), dtype=np.float32)
    x_buf = device.from_numpy(x)
    out = device.alloc(m * N * 4, routemm.DType.F32, [m, N])
    params = routemm.GgmlQuantizedMatmulParams(m, N, K)
    receipts = []

    def run():
        encoder = device.command_encoder()
        receipts.append(
            routemm.quantized_matmul_ggml(encoder, registry, x_buf, w_buf, out, params, routemm.GgmlRoutingPolicy())
        )
        encoder.commit_and_wait()

    benchmark.pedantic(run, rounds=ROUNDS[m], warmup_rounds=1)
    got = out.numpy()
    np.testing.assert_allclose(got, _numpy_formulation(blocks[:], x), rtol=2e-3, atol=2e-3)
    _record(results, benchmark, m=m, route=receipts[-1].route, impl="routemm")


@pytest.mark.parametrize("m", sorted(ROUNDS))
def test_numpy(benchmark, results, weight, m):
    blocks, _ = weight
    x = np.random.default_rng(m).standard_normal((m, K), dtype=np.float32)
    benchmark.pedantic(_numpy_formulation, args=(blocks, x), rounds=min(ROUNDS[m], 3), warmup_rounds=1)
    _record(
        results,
        benchmark,
        m=m,
        route="dequantize+matmul",
        impl="numpy",
        note="vectorised NumPy dequantise to f32, then BLAS",
    )
