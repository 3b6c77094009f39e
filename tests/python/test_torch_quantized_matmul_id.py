"""torch.ops.routemm.quantized_matmul_id (GGML Q4_0 / Q8_0 expert stacks) and routemm.matmul_id(...,
ggml_type=...) on tensors: the same bits as the NumPy front door on the same device, zero rows for
invalid ids, repeated ids computed by the shape-chosen grouped route, fake tensors,
torch.compile(fullgraph=True), one extension crossing per eager call and, on CUDA, no host sync
and capture in a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch  # noqa: E402,F401  (registers torch.ops.routemm.*)
from routemm import GgmlQuantizedMatmulIdRoute as Route  # noqa: E402
from routemm import q4_0, q8_0  # noqa: E402
from tolerances import accumulation_bound  # noqa: E402
from torch_devices import have_torch_cuda  # noqa: E402

E, N, K = 6, 24, 96  # K = 3 blocks: no tile of 64 or 128 values divides it
FORMATS = {"q4_0": q4_0, "q8_0": q8_0}


def _stack(ggml_type: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 blocks [E, N, K / 32 * block_bytes], their dequantised float32 values)."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.standard_normal((E, N, K)).astype(np.float32))
    return blocks, fmt.dequantize(blocks)


def _routing(m: int, top_k: int, seed: int = 1, repeat: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, K)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:top_k] for _ in range(m)]).astype(np.int64)
    if repeat:
        ids[:, -1] = ids[:, 0]  # every token names one expert twice
    return x, ids


def _numpy_direct(blocks, x, ids, ggml_type, tdev):
    """The NumPy front door's direct route on the same backend (its bits are the contract)."""
    return routemm.matmul_id(blocks, x, ids, ggml_type=ggml_type, route=Route.DIRECT, device=tdev)


def _check_reference(got: np.ndarray, deq: np.ndarray, x: np.ndarray, ids: np.ndarray) -> None:
    m, top_k = ids.shape
    for t in range(m):
        for s in range(top_k):
            e, row = int(ids[t, s]), got[t * top_k + s]
            if not 0 <= e < E:
                assert np.all(row == 0), (t, s)
                continue
            exact = deq[e].astype(np.float64) @ x[t].astype(np.float64)
            magnitude = np.abs(deq[e]).astype(np.float64) @ np.abs(x[t]).astype(np.float64)
            assert np.all(np.abs(row - exact) <= accumulation_bound(K, magnitude)), (t, s)


@pytest.mark.parametrize("ggml_type", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 40])
def test_op_equals_the_numpy_front_door_bit_for_bit(tdev, ggml_type, m):
    """m = 40 x top-2 over 6 experts takes the exact grouped route from the shape on the CPU
    (auto_grouped), which sums in direct's order: every m gives direct's bits."""
    blocks, deq = _stack(ggml_type)
    x, ids = _routing(m, 2)
    y = torch.ops.routemm.quantized_matmul_id(
        torch.from_numpy(blocks).to(tdev), torch.from_numpy(x).to(tdev), torch.from_numpy(ids).to(tdev), ggml_type
    )
    assert y.shape == (m * 2, N) and y.dtype == torch.float32 and y.device.type == tdev
    got = y.cpu().numpy()
    assert np.array_equal(got.view(np.uint32), _numpy_direct(blocks, x, ids, ggml_type, tdev).view(np.uint32))
    _check_reference(got, deq, x, ids)


@pytest.mark.parametrize("ggml_type", sorted(FORMATS))
def test_repeated_ids_on_the_shape_chosen_grouped_route(tdev, ggml_type):
    """No host read of the ids: 40 tokens naming one expert twice run the grouped route the shape
    picks on the CPU (direct on CUDA at this size), and every slot is computed."""
    blocks, deq = _stack(ggml_type, seed=2)
    x, ids = _routing(40, 3, seed=3, repeat=True)
    tx, tids = torch.from_numpy(x).to(tdev), torch.from_numpy(ids).to(tdev)
    y, receipt = routemm.matmul_id(
        torch.from_numpy(blocks).to(tdev), tx, tids, ggml_type=ggml_type, return_receipt=True
    )
    assert receipt.route == (Route.GROUPED if tdev == "cpu" else Route.DIRECT)
    assert torch.equal(y, torch.ops.routemm.quantized_matmul_id(torch.from_numpy(blocks).to(tdev), tx, tids, ggml_type))
    got = y.cpu().numpy()
    assert np.array_equal(got.view(np.uint32), _numpy_direct(blocks, x, ids, ggml_type, tdev).view(np.uint32))
    _check_reference(got, deq, x, ids)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_out_of_range_ids_give_zero_rows(tdev, id_dtype):
    blocks, deq = _stack("q4_0")
    x, ids = _routing(3, 2)
    tids = torch.from_numpy(ids).to(id_dtype)
    tids[0, 1] = E
    tids[1, 0] = -3
    if id_dtype == torch.int64:
        tids[2, 1] = 2**32 + 1  # would wrap to expert 1 as int32
    y = torch.ops.routemm.quantized_matmul_id(
        torch.from_numpy(blocks).to(tdev), torch.from_numpy(x).to(tdev), tids.to(tdev), "q4_0"
    ).cpu()
    zero = [1, 2] + ([5] if id_dtype == torch.int64 else [])
    for row in range(6):
        assert bool(torch.all(y[row] == 0)) == (row in zero), row
    reference_ids = tids.numpy().copy()
    reference_ids[(reference_ids < 0) | (reference_ids >= E)] = E
    _check_reference(y.numpy(), deq, x, reference_ids)


def test_slotted_activations_and_an_explicit_route(tdev):
    """x [m, top_k, k] (one row per slot, the expert-down form's input) and a named route, given as
    an enum or its value, through routemm.matmul_id on tensors."""
    blocks, _ = _stack("q8_0", seed=4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 2, K)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:2] for _ in range(5)]).astype(np.int64)
    tb, tx, tids = (torch.from_numpy(a).to(tdev) for a in (blocks, x, ids))
    want = _numpy_direct(blocks, x, ids, "q8_0", tdev)
    for route in (Route.GROUPED, "grouped", None):
        y, receipt = routemm.matmul_id(tb, tx, tids, ggml_type="q8_0", route=route, return_receipt=True)
        assert receipt.route == (Route.DIRECT if route is None else Route.GROUPED)
        assert np.array_equal(y.cpu().numpy().view(np.uint32), want.view(np.uint32)), route
    out = torch.full((10, N), float("nan"), device=tdev)
    assert routemm.matmul_id(tb, tx, tids, ggml_type="q8_0", out=out) is out
    assert np.array_equal(out.cpu().numpy().view(np.uint32), want.view(np.uint32))


def test_int8_dot_route_on_cpu_tensors():
    """A CPU-only named route runs on CPU tensors and equals the NumPy front door's bits."""
    blocks, _ = _stack("q4_0", seed=6)
    x, ids = _routing(4, 2, seed=7)
    y = routemm.matmul_id(
        torch.from_numpy(blocks), torch.from_numpy(x), torch.from_numpy(ids), ggml_type="q4_0",
        route=Route.DIRECT_INT8_DOT,
    )  # fmt: skip
    want = routemm.matmul_id(blocks, x, ids, ggml_type="q4_0", route=Route.DIRECT_INT8_DOT, device="cpu")
    assert np.array_equal(y.numpy().view(np.uint32), want.view(np.uint32))


def test_rejections_before_anything_runs(tdev):
    """The op raises ValueError from either kernel set (routemm.InvalidArgumentError is one); the
    front door raises routemm.InvalidArgumentError."""
    blocks, _ = _stack("q4_0")
    x, ids = _routing(2, 2)
    tb, tx, tids = (torch.from_numpy(a).to(tdev) for a in (blocks, x, ids))
    op = torch.ops.routemm.quantized_matmul_id
    with pytest.raises(ValueError, match="ggml_type must be one of 'q4_0', 'q8_0', 'q4_1'.*got 'q3_k'"):
        op(tb, tx, tids, "q3_k")
    with pytest.raises(ValueError, match=r"k / 32 \* 34"):
        op(tb, tx, tids, "q8_0")  # Q4_0 rows of 3 * 18 bytes are no whole number of Q8_0 blocks
    with pytest.raises(ValueError, match="must be uint8 blocks"):
        op(tb.to(torch.int8), tx, tids, "q4_0")
    with pytest.raises(ValueError, match="activations must be float32"):
        op(tb, tx.double(), tids, "q4_0")
    with pytest.raises(ValueError, match="x must be"):
        op(tb, tx[:, :64], tids, "q4_0")
    with pytest.raises(ValueError, match="ids must be integers"):
        op(tb, tx, tids.float(), "q4_0")
    with pytest.raises(ValueError, match="contiguous"):
        op(tb, torch.cat([tx, tx], 1)[:, ::2], tids, "q4_0")
    with pytest.raises(routemm.InvalidArgumentError, match="exceeds n_experts"):
        routemm.matmul_id(tb, tx, tids[:, :1].repeat(1, E + 1), ggml_type="q4_0", route="grouped")
    with pytest.raises(routemm.InvalidArgumentError, match="route"):
        routemm.matmul_id(tb, tx, tids, ggml_type="q4_0", route="grouped_prefill_typo")


@pytest.mark.parametrize("ggml_type", [None, "q4_0"])
def test_mixed_frameworks_are_refused_by_name(ggml_type):
    """routemm.matmul_id on tensors takes its framework from x; a NumPy array among the other
    arguments (float or block stack) is an InvalidArgumentError that names it, not a crash."""
    weights = _stack("q4_0")[0] if ggml_type else np.random.default_rng(8).standard_normal((E, N, K)).astype(np.float32)
    x, ids = _routing(2, 2)
    routemm.matmul_id(*(torch.from_numpy(a) for a in (weights, x, ids)), ggml_type=ggml_type)  # a cached plan
    tw, tx, tids = (torch.from_numpy(a) for a in (weights, x, ids))
    for args, name in (((weights, tx, tids), "weights"), ((tw, tx, ids), "ids")):
        with pytest.raises(routemm.InvalidArgumentError, match=f"so {name} must be one too, got numpy.ndarray"):
            routemm.matmul_id(*args, ggml_type=ggml_type)
    with pytest.raises(routemm.InvalidArgumentError, match="out must be a contiguous float32 tensor"):
        routemm.matmul_id(tw, tx, tids, ggml_type=ggml_type, out=np.zeros((4, N), np.float32))


def test_fake_tensors_propagate_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        blocks = torch.empty(E, N, K // 32 * 34, dtype=torch.uint8)
        y = torch.ops.routemm.quantized_matmul_id(
            blocks, torch.empty(5, 2, K), torch.empty(5, 2, dtype=torch.int64), "q8_0"
        )
        assert y.shape == (10, N) and y.dtype == torch.float32
        with pytest.raises(routemm.InvalidArgumentError, match="x must be"):
            torch.ops.routemm.quantized_matmul_id(blocks, torch.empty(5, K + 32), torch.empty(5, 2), "q8_0")


def test_torch_compile_fullgraph(tdev):
    blocks, _ = _stack("q4_0")
    x, ids = _routing(4, 2)
    tb, tx, tids = (torch.from_numpy(a).to(tdev) for a in (blocks, x, ids))

    def step(tb, tx, tids):
        return torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q4_0").relu() + 1

    eager = step(tb, tx, tids)
    assert torch.equal(torch.compile(step, fullgraph=True)(tb, tx, tids), eager)


def test_registration_place():
    assert routemm.torch.op("quantized_matmul_id") is routemm.torch.quantized_matmul_id


def test_eager_call_is_one_extension_crossing(monkeypatch):
    """After a shape's first call the op neither wraps buffers nor builds an encoder in Python."""
    from routemm import _core

    blocks, _ = _stack("q8_0")
    x, ids = _routing(1, 2)
    tb, tx, tids = (torch.from_numpy(a) for a in (blocks, x, ids))
    first = torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q8_0")

    def forbidden(*args, **kwargs):
        raise AssertionError("the per-call path crossed into the extension more than once")

    monkeypatch.setattr(_core, "_buffer_from_pointer", forbidden)
    monkeypatch.setattr(_core, "_quantized_matmul_id_ggml", forbidden)
    monkeypatch.setattr(_core, "_plan_tensor_quantized_matmul_id", forbidden)
    monkeypatch.setattr(_core.Device, "_command_encoder", forbidden)
    assert torch.equal(torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q8_0"), first)


@pytest.mark.skipif(not have_torch_cuda(), reason="needs a CUDA device and routemm's CUDA backend")
def test_cuda_no_sync_no_alloc_no_stream_and_graph_capture():
    blocks, _ = _stack("q4_0")
    x, ids = _routing(1, 2)
    tb, tx, tids = (torch.from_numpy(a).cuda() for a in (blocks, x, ids))
    tids = tids.to(torch.int32)
    side = torch.cuda.Stream()
    torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q4_0")
    with torch.cuda.stream(side):
        torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q4_0")
    torch.cuda.synchronize()
    routemm.reset_encoder_counters()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            y = torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q4_0")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    c = routemm.encoder_counters()
    assert (c["host_waits"], c["streams_created"], c["device_allocations"]) == (0, 0, 0)
    assert torch.cuda.memory_stats().get("segment.all.allocated", 0) == segments
    torch.cuda.synchronize()
    eager = torch.ops.routemm.quantized_matmul_id(tb, tx, tids, "q4_0")
    assert torch.equal(y, eager)
    graph = torch.cuda.CUDAGraph()
    static_x = tx.clone()
    with torch.cuda.graph(graph):
        static_y = [torch.ops.routemm.quantized_matmul_id(tb, static_x, tids, "q4_0") for _ in range(3)]
    graph.replay()
    torch.cuda.synchronize()
    for out in static_y:
        assert torch.equal(out, eager)
