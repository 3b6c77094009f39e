"""torch.ops.routemm.*: against the reference, under torch.compile(fullgraph=True), with fake
tensors, and (on CUDA) on the current stream with no host sync and inside torch.cuda.graph."""

from __future__ import annotations

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch  # noqa: E402,F401  (registers torch.ops.routemm.*)
from routemm import q4_0  # noqa: E402
from tolerances import accumulation_bound, q4_gpu_bound  # noqa: E402
from torch_devices import have_torch_cuda  # noqa: E402

E, N, K = 8, 40, 64


def _moe(tdev, m, top_k=2, seed=0, dtype=torch.bfloat16, repeat=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    x = torch.randn(m, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(m)])
    if repeat:
        ids[:, -1] = ids[:, 0]  # every token names one expert twice
    return w.to(tdev), x.to(tdev), ids.to(tdev)


def _reference(w, x, ids):
    w64 = w.double().cpu()
    x64 = x.double().cpu()
    rows = [w64[e] @ x64[t] for t in range(ids.shape[0]) for e in ids[t].tolist()]
    return torch.stack(rows)


@pytest.mark.parametrize("m", [1, 3, 16])
def test_matmul_id_matches_reference(tdev, m):
    w, x, ids = _moe(tdev, m)
    y = torch.ops.routemm.matmul_id(w, x, ids)
    assert y.shape == (m * 2, N) and y.dtype == torch.float32 and y.device.type == tdev
    assert torch.allclose(y.double().cpu(), _reference(w, x, ids), rtol=1e-5, atol=1e-4)


def test_shape_only_route_is_bit_identical_for_repeated_ids(tdev):
    """32 tokens x 3 slots over 8 experts (12 rows per expert) take grouped_prefill from the shape
    alone on every backend (auto_grouped); repeated ids must not matter."""
    w, x, ids = _moe(tdev, 32, top_k=3, repeat=True)
    grouped = torch.ops.routemm.matmul_id(w, x, ids)
    direct = routemm.matmul_id(w, x, ids, route=routemm.DenseMatmulIdRoute.DIRECT)
    assert torch.equal(grouped.view(torch.int32), direct.view(torch.int32))
    assert torch.allclose(grouped.double().cpu(), _reference(w, x, ids), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_out_of_range_ids_give_zero_rows(tdev, id_dtype):
    w, x, ids = _moe(tdev, 3)
    ids = ids.to(id_dtype)
    ids[0, 1] = E
    ids[1, 0] = -3
    if id_dtype == torch.int64:
        ids[2, 1] = 2**32 + 1  # would wrap to expert 1 as int32
    y = torch.ops.routemm.matmul_id(w, x, ids).cpu()
    zero = [1, 2] + ([5] if id_dtype == torch.int64 else [])
    for row in range(6):
        assert bool(torch.all(y[row] == 0)) == (row in zero), row


def test_fake_tensors_propagate_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(E, N, K, dtype=torch.bfloat16)
        x = torch.empty(5, 2, K)
        ids = torch.empty(5, 2, dtype=torch.int64)
        y = torch.ops.routemm.matmul_id(w, x, ids)
        assert y.shape == (10, N) and y.dtype == torch.float32
        q = torch.ops.routemm.q4_matmul(torch.empty(3, 64), torch.empty(N, 2 * 18, dtype=torch.uint8), N, 64)
        assert q.shape == (3, N) and q.dtype == torch.float32
        with pytest.raises(routemm.InvalidArgumentError, match="must be"):
            torch.ops.routemm.matmul_id(w, torch.empty(5, K + 1), ids)


def test_torch_compile_fullgraph(tdev):
    w, x, ids = _moe(tdev, 4)
    blocks = _q4_blocks(N, K).to(tdev)

    def step(w, x, ids, blocks):
        h = torch.ops.routemm.matmul_id(w, x, ids)
        return h.relu() + 1, torch.ops.routemm.q4_matmul(x, blocks, N, K)

    eager = step(w, x, ids, blocks)
    compiled = torch.compile(step, fullgraph=True)(w, x, ids, blocks)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def _q4_blocks(n, k, seed=1):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32)))


@pytest.mark.parametrize("m", [1, 9])
def test_q4_matmul_matches_dequantized_reference(tdev, m):
    blocks = _q4_blocks(N, K)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    y = torch.ops.routemm.q4_matmul(x.to(tdev), blocks.to(tdev), N, K)
    w = torch.from_numpy(q4_0.dequantize(blocks.numpy())).double()
    assert y.shape == (m, N)
    exact = (x.double() @ w.T).numpy()
    magnitude = (x.double().abs() @ w.abs().T).numpy()
    # The route's own bound: F32 chains on the CPU; on CUDA the loosest Q4_0 route numerics (the
    # bf16 tensor routes a multi-token call may take by default).
    bound = q4_gpu_bound("tensor_64x32", K, magnitude) if tdev == "cuda" else accumulation_bound(K, magnitude)
    assert np.all(np.abs(y.double().cpu().numpy() - exact) <= bound)


def test_registration_place():
    assert set(routemm.torch.OPS) >= {"matmul_id", "q4_matmul"}
    assert routemm.torch.op("matmul_id") is routemm.torch.matmul_id
    assert routemm.torch.op("missing") is None


@pytest.mark.skipif(not have_torch_cuda(), reason="needs a CUDA device and routemm's CUDA backend")
def test_cuda_no_sync_no_alloc_no_stream_and_graph_capture():
    w, x, ids = _moe("cuda", 1, top_k=8)
    side = torch.cuda.Stream()
    # Warm: pipelines and pools, and PyTorch's caching allocator on both streams (its blocks are
    # per stream, so the side stream's first output would take a segment of its own).
    torch.ops.routemm.matmul_id(w, x, ids)
    with torch.cuda.stream(side):
        torch.ops.routemm.matmul_id(w, x, ids)
    torch.cuda.synchronize()
    routemm.reset_encoder_counters()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            y = torch.ops.routemm.matmul_id(w, x, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    c = routemm.encoder_counters()
    assert (c["host_waits"], c["streams_created"], c["device_allocations"]) == (0, 0, 0)
    assert torch.cuda.memory_stats().get("segment.all.allocated", 0) == segments
    torch.cuda.synchronize()
    eager = torch.ops.routemm.matmul_id(w, x, ids)
    assert torch.equal(y, eager)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        static_y = [torch.ops.routemm.matmul_id(w, static_x, ids) for _ in range(3)]
    graph.replay()
    torch.cuda.synchronize()
    for out in static_y:
        assert torch.equal(out, eager)


def test_eager_call_is_one_extension_crossing(monkeypatch):
    """After a shape's first call, matmul_id on tensors neither wraps buffers nor builds an encoder
    in Python: the wrapping, encoding and start happen in one extension call (the decode-loop path)."""
    from routemm import _core

    w, x, ids = _moe("cpu", 1, top_k=2)
    first = torch.ops.routemm.matmul_id(w, x, ids)

    def forbidden(*args, **kwargs):
        raise AssertionError("the per-call path crossed into the extension more than once")

    monkeypatch.setattr(_core, "_buffer_from_pointer", forbidden)
    monkeypatch.setattr(_core, "_dense_matmul_id", forbidden)
    monkeypatch.setattr(_core.Device, "_command_encoder", forbidden)
    assert torch.equal(torch.ops.routemm.matmul_id(w, x, ids), first)
