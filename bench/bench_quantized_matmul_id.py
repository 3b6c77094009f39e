"""CPU benchmarks of the quantised expert-ID matmul (quantized_matmul_id_ggml) on Q4_0 / Q8_0
expert stacks of Qwen3-30B-A3B (E 128, top-8, 768 x 2048) and Qwen3.6-35B-A3B (E 256, top-8,
512 x 2048). Decode (m=1) runs the direct route, prefill the grouped route. The expert IDs change
every round, so decode streams the touched experts' blocks from memory, not from cache; bytes
count those blocks. ROUTEMM_BENCH_QID_M (a comma list) overrides the token counts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import routemm
from routemm import GgmlQuantizedMatmulIdRoute as Route
from routemm import GgmlType

SHAPES = {"qwen3-30b-a3b": (128, 8, 768, 2048), "qwen3.6-35b-a3b": (256, 8, 512, 2048)}
TYPES = {"q4_0": GgmlType.Q4_0, "q8_0": GgmlType.Q8_0}
M_VALUES = [int(v) for v in os.environ.get("ROUTEMM_BENCH_QID_M", "1,32").split(",") if v.strip()]


@pytest.fixture(scope="module")
def device():
    return routemm.Device("cpu")


@pytest.fixture(scope="module")
def registry(device):
    return routemm.KernelRegistry(device)


@pytest.fixture(scope="module", params=[(s, t) for s in SHAPES for t in TYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def stack(request, device):
    shape, type_name = request.param
    e, _, n, k = SHAPES[shape]
    ggml_type = TYPES[type_name]
    fmt = routemm.q4_0 if ggml_type is GgmlType.Q4_0 else routemm.q8_0
    rng = np.random.default_rng(0)
    blocks = np.stack([fmt.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02) for _ in range(e)])
    return shape, ggml_type, blocks, device.from_numpy(blocks)


@pytest.mark.parametrize("m", M_VALUES)
def test_routemm(benchmark, results, device, registry, stack, m):
    shape, ggml_type, blocks, w_buf = stack
    e, top_k, n, k = SHAPES[shape]
    route = Route.DIRECT if m == 1 else Route.GROUPED
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k), dtype=np.float32)
    x_buf = device.from_numpy(x)
    out = device.alloc(m * top_k * n * 4, routemm.DType.F32, [m * top_k, n])
    stride = blocks.shape[1] * blocks.shape[2]
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, e, ggml_type, stride, route=route)
    scratch = routemm.DenseMatmulIdScratch(device, e, m) if route.is_grouped else None
    rounds = 20 if m == 1 else 3
    id_sets = [np.argsort(rng.random((m, e)), axis=1)[:, :top_k].astype(np.uint32) for _ in range(rounds + 2)]
    id_bufs = iter([(ids, device.from_numpy(ids)) for ids in id_sets])
    last = {}

    def setup():
        last["ids"], id_buf = next(id_bufs)
        return (id_buf,), {}

    def run(id_buf):
        encoder = device.command_encoder()
        routemm.quantized_matmul_id_ggml(encoder, registry, x_buf, w_buf, id_buf, out, scratch, params)
        encoder.commit_and_wait()

    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=1)
    # Correctness of the measured configuration on the last ids (float64 on dequantised experts).
    fmt = routemm.q4_0 if ggml_type is GgmlType.Q4_0 else routemm.q8_0
    ids = last["ids"]
    got = out.numpy()
    for flat in range(0, m * top_k, max(1, m * top_k // 8)):
        w = fmt.dequantize(blocks[ids.reshape(-1)[flat]]).astype(np.float64)
        ref = w @ x[flat // top_k].astype(np.float64)
        assert np.allclose(got[flat], ref, rtol=1e-4, atol=1e-4)
    seconds = benchmark.stats.stats.median
    touched = len(np.unique(ids))
    weight_bytes = touched * stride
    flops = 2 * m * top_k * n * k
    results.add(
        op="quantized_matmul_id",
        shape=shape,
        m=m,
        weight_dtype=ggml_type.value,
        route=route.value,
        impl="routemm",
        time_us=seconds * 1e6,
        bytes=weight_bytes,
        flops=flops,
        TBps=weight_bytes / seconds / 1e12,
        TFLOPs=flops / seconds / 1e12,
        note=f"{touched} touched experts",
    )
