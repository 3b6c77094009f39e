"""torch.ops.routemm.moe_experts: the MoE experts block as one op. On the exact routes it gives the
bits of routemm.moe_experts (the NumPy front door's contract) for float stacks (f32, f16, bf16; one
gate_up stack or gate and up apart) and GGML block stacks; it takes and returns the model's dtype,
skips invalid ids whatever their integer dtype, agrees with a float64 reference, has a fake
implementation (torch.compile(fullgraph=True)), gives the same bits and errors with both kernel
sets, and on CUDA runs without a host sync, inside a CUDA graph, and within the tensor-core route's
bound on the automatic route."""

from __future__ import annotations

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch as rt  # noqa: E402
from torch_devices import have_torch_cuda  # noqa: E402

E, H, I, TOP_K = 6, 64, 32, 2  # noqa: E741
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _float_stacks(dtype, split: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn((E, 2 * I, H), generator=g) / H**0.5).to(dtype)
    down = (torch.randn((E, H, I), generator=g) / I**0.5).to(dtype)
    if split:
        return (gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()), down
    return gate_up, down


def _block_stacks(ggml_type: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    fmt = {"q4_0": routemm.q4_0, "q8_0": routemm.q8_0}[ggml_type]
    gate, up = (torch.from_numpy(fmt.quantize(rng.standard_normal((E, I, H)).astype(np.float32))) for _ in range(2))
    down = torch.from_numpy(fmt.quantize(rng.standard_normal((E, H, I)).astype(np.float32)))
    return (gate, up), down


def _routing(m: int, seed: int = 1, invalid: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, H), generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).to(torch.int32)
    if invalid and m > 2:
        ids[1, 1] = -1  # an invalid id
        ids[2, 0] = E  # an expert-parallel sentinel
    weights = torch.rand((m, TOP_K), generator=g)
    return x, ids, weights


def _op(x, ids, w, gate_up, down, **kw):
    if isinstance(gate_up, tuple):
        return torch.ops.routemm.moe_experts(x, ids, w, gate_up[0], down, up=gate_up[1], **kw)
    return torch.ops.routemm.moe_experts(x, ids, w, gate_up, down, **kw)


def _to(tdev, *ts):
    return [tuple(u.to(tdev) for u in t) if isinstance(t, tuple) else t.to(tdev) for t in ts]


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("split", [False, True], ids=["gate_up", "gate+up"])
@pytest.mark.parametrize("dtype", sorted(FLOAT_DTYPES))
def test_exact_float_stacks_are_the_front_doors_bits(tdev, dtype, split, m):
    gate_up, down = _float_stacks(FLOAT_DTYPES[dtype], split)
    x, ids, w = _routing(m)
    x, ids, w, gate_up, down = _to(tdev, x, ids, w, gate_up, down)
    want = routemm.moe_experts(x, ids, w, gate_up, down)
    got = _op(x, ids, w, gate_up, down, exact=True)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if tdev == "cpu":  # the automatic route is the exact one off CUDA
        assert torch.equal(_op(x, ids, w, gate_up, down), want)


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("ggml_type", ["q4_0", "q8_0"])
def test_exact_block_stacks_are_the_front_doors_bits(tdev, ggml_type, m):
    gate_up, down = _block_stacks(ggml_type)
    x, ids, w = _routing(m)
    x, ids, w, gate_up, down = _to(tdev, x, ids, w, gate_up, down)
    want = routemm.moe_experts(x, ids, w, gate_up, down, ggml_type=ggml_type)
    got = _op(x, ids, w, gate_up, down, ggml_type=ggml_type, exact=True)
    assert torch.equal(got, want)


def test_float64_reference_and_invalid_ids_contribute_nothing():
    gate_up, down = _float_stacks(torch.bfloat16, split=False)
    x, ids, w = _routing(9)
    got = _op(x, ids, w, gate_up, down, exact=True).double()
    g64, d64, x64 = gate_up.double(), down.double(), x.double()
    for t in range(x.shape[0]):
        acc = torch.zeros(H, dtype=torch.float64)
        mag = torch.zeros(H, dtype=torch.float64)
        for s in range(TOP_K):
            e = int(ids[t, s])
            if not 0 <= e < E:
                continue
            gu = g64[e] @ x64[t]
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            acc += float(w[t, s]) * (d64[e] @ h)
            mag += float(w[t, s]) * (d64[e].abs() @ h.abs())
        # F32 accumulation over H then I terms: a loose bound of the two products' rounding.
        assert torch.all((got[t] - acc).abs() <= 1e-5 * (mag + 1) + 4 * (H + I) * 2**-24 * mag), t


@pytest.mark.parametrize(
    "dtype", [torch.int8, torch.int16, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]
)
def test_every_integer_id_dtype_gives_the_int32_bits(dtype):
    gate_up, down = _float_stacks(torch.float32, split=False)
    x, ids, w = _routing(5)
    want = _op(x, ids, w, gate_up, down, exact=True)
    wide = ids.to(torch.int64)
    if not dtype.is_signed:
        wide = torch.where(wide < 0, torch.full_like(wide, E + 1), wide)  # unsigned: no -1
    assert torch.equal(_op(x, wide.to(dtype), w, gate_up, down, exact=True), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_ids_are_refused(dtype):
    gate_up, down = _float_stacks(torch.float32, split=False)
    x, ids, w = _routing(3)
    with pytest.raises(ValueError, match="ids must be integers"):
        _op(x, ids.to(dtype), w, gate_up, down)


@pytest.mark.parametrize("model", [torch.float16, torch.bfloat16])
def test_model_dtype_in_and_out(tdev, model):
    gate_up, down = _float_stacks(torch.bfloat16, split=False)
    x, ids, w = _routing(7)
    x, ids, w, gate_up, down = _to(tdev, x.to(model), ids, w.to(model), gate_up, down)
    got = _op(x, ids, w, gate_up, down, exact=True)
    want = routemm.moe_experts(x.float(), ids, w.float(), gate_up, down).to(model)
    assert got.dtype == model and torch.equal(got, want)


def test_errors_name_the_argument():
    gate_up, down = _float_stacks(torch.float32, split=False)
    x, ids, w = _routing(3)
    cases = [
        ((x.int(), ids, w, gate_up, down), {}, "hidden must be float32, float16 or bfloat16"),
        ((x, ids, w.int(), gate_up, down), {}, "top_k_weights must be float32, float16 or bfloat16"),
        ((x, ids[:, :1], w, gate_up, down), {}, "top_k_weights must have the shape of top_k_index"),
        ((x, ids, w, gate_up[:, :-1], down), {}, r"gate_up must be \(6, 64, 64\)"),
        ((x, ids, w, gate_up, down[:, :-1]), {}, r"down must be \[E, 64, I\]"),
        ((x, ids, w, gate_up, down.half()), {}, "weight stacks must share one dtype"),
        ((x, ids, w, gate_up, down), {"ggml_type": "q4_k"}, "ggml_type must be None, 'q4_0' or 'q8_0'"),
        ((x, ids, w, gate_up, down), {"ggml_type": "q4_0"}, "block stacks must be uint8 blocks"),
        ((x[:, :0], ids, w, gate_up, down), {}, r"down must be \[E, 0, I\]"),
    ]
    for args, kw, message in cases:
        with pytest.raises(ValueError, match=message):  # InvalidArgumentError from the Python kernels
            torch.ops.routemm.moe_experts(*args, **kw)


def test_fake_and_torch_compile_fullgraph():
    gate_up, down = _float_stacks(torch.bfloat16, split=False)
    x, ids, w = _routing(4)
    xb, wb = x.bfloat16(), w.bfloat16()
    eager = _op(xb, ids, wb, gate_up, down)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = _op(*(mode.from_tensor(t) for t in (xb, ids, wb, gate_up, down)))
    assert fake.shape == eager.shape and fake.dtype == torch.bfloat16
    compiled = torch.compile(lambda *a: torch.ops.routemm.moe_experts(*a), fullgraph=True)
    assert torch.equal(compiled(xb, ids, wb, gate_up, down), eager)


def test_both_kernel_sets_give_the_same_bits_and_errors():
    gate_up, down = _float_stacks(torch.bfloat16, split=True)
    x, ids, w = _routing(12)
    op = _op(x, ids, w, gate_up, down)
    python = rt._moe_experts(x, ids, w, gate_up[0], down, gate_up[1])
    assert torch.equal(op, python)
    for bad in ((x, ids[:, :1], w, gate_up[0], down, gate_up[1]), (x.int(), ids, w, gate_up[0], down)):
        with pytest.raises(ValueError) as from_op:
            torch.ops.routemm.moe_experts(*bad)
        with pytest.raises(ValueError) as from_python:
            rt._moe_experts(*bad)
        assert str(from_op.value) == str(from_python.value)


@pytest.mark.skipif(not have_torch_cuda(), reason="needs a CUDA device and routemm's CUDA backend")
@pytest.mark.parametrize("m", [1, 8, 512])
def test_cuda_no_sync_no_alloc_graph_capture_and_the_lowp_bound(m):
    gate_up, down = _float_stacks(torch.bfloat16, split=False)
    x, ids, w = _routing(m, invalid=False)
    gate_up, down, x, ids, w = (t.cuda() for t in (gate_up, down, x.bfloat16(), ids, w.bfloat16()))
    first = _op(x, ids, w, gate_up, down)
    torch.cuda.synchronize()
    routemm.reset_encoder_counters()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            y = _op(x, ids, w, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    c = routemm.encoder_counters()
    assert (c["host_waits"], c["streams_created"], c["device_allocations"]) == (0, 0, 0)
    assert torch.cuda.memory_stats().get("segment.all.allocated", 0) == segments
    torch.cuda.synchronize()
    assert torch.equal(y, first)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        static_y = _op(static_x, ids, w, gate_up, down)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, first)
    # The automatic route (tensor cores from the crossover on) against the exact F32 route: the
    # lowp route rounds activations to bf16, so the bound is bf16's (2^-8 relative) on the sum.
    exact = _op(x, ids, w, gate_up, down, exact=True).float()
    err = float((first.float() - exact).abs().max() / exact.abs().max())
    assert err <= 2**-6, err
