"""The fused decode route of torch.ops.routemm.moe_experts on CUDA (routemm/ops/moe_experts_fused.h):
at up to a quarter of a routed row per expert a float-stack call in the model's dtype runs as two launches that read
the hidden states, the int32/int64 ids and the routing weights as given. Checked against a float64
reference and against the exact route, for every dtype, id width, split and sentinel id; inside a
CUDA graph (replay equals eager, bit for bit); and by its launches (two kernels, no conversion).
The CPU kernels of the same op are checked by tests/cpp/test_moe_fused.cpp."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import routemm.torch as rt  # noqa: E402
from torch_devices import have_torch_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(
    not have_torch_cuda() or rt.KERNELS != "cpp", reason="needs a CUDA device and routemm._torch_ops"
)

E, H, I, TOP_K = 64, 128, 64, 4  # noqa: E741  (m <= 4 tokens are fused: 4 * m * TOP_K <= E)
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _case(m: int, dtype, split: bool, id_dtype, w_dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, H), generator=g)
    gate_up = torch.randn((E, 2 * I, H), generator=g) / H**0.5
    down = torch.randn((E, H, I), generator=g) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)])
    if m > 1:
        ids[0, 1] = -1  # invalid
        ids[1, 0] = E  # expert-parallel sentinel
    w = torch.rand((m, TOP_K), generator=g)
    cuda = [t.to("cuda") for t in (x.to(dtype), ids.to(id_dtype), w.to(w_dtype), gate_up.to(dtype), down.to(dtype))]
    if split:
        gu = cuda[3]
        cuda[3] = (gu[:, :I].contiguous(), gu[:, I:].contiguous())
    return cuda


def _op(x, ids, w, gate_up, down, **kw):
    if isinstance(gate_up, tuple):
        return torch.ops.routemm.moe_experts(x, ids, w, gate_up[0], down, up=gate_up[1], **kw)
    return torch.ops.routemm.moe_experts(x, ids, w, gate_up, down, **kw)


def _reference(x, ids, w, gate_up, down):
    """float64 on the same (rounded) inputs."""
    if isinstance(gate_up, tuple):
        gate_up = torch.cat(gate_up, dim=1)
    x, w, gate_up, down = (t.double().cpu() for t in (x, w, gate_up, down))
    ids = ids.long().cpu()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if not 0 <= e < E:
                continue
            gu = gate_up[e] @ x[t]
            a = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[t] += w[t, s] * (down[e] @ a)
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_route_matches_float64_and_exact(dtype, id_dtype, split, m):
    args = _case(m, DTYPES[dtype], split, id_dtype, DTYPES[dtype])
    got = _op(*args)
    assert got.dtype == DTYPES[dtype] and got.shape == (m, H)
    ref = _reference(*args)
    unit = {"f32": 2**-20, "f16": 2**-10, "bf16": 2**-7}[dtype]
    err = (got.double().cpu() - ref).abs()
    assert torch.isfinite(got).all()
    assert (err <= unit * (ref.abs() + 1)).all(), float(err.max())
    exact = _op(*args, exact=True)
    assert ((got.double() - exact.double()).abs().cpu() <= 2 * unit * (ref.abs() + 1)).all()


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_routing_weights_are_read_in_their_own_dtype(w_dtype):
    args = _case(2, torch.bfloat16, False, torch.int64, w_dtype, seed=3)
    ref = _reference(*args)
    err = (_op(*args).double().cpu() - ref).abs()
    assert (err <= 2**-7 * (ref.abs() + 1)).all()


def test_two_launches_and_no_conversion():
    args = _case(1, torch.bfloat16, False, torch.int64, torch.bfloat16)
    _op(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _op(*args)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2 and all("moe" in k or "kernel" in k for k in kernels), kernels


def test_replay_in_a_cuda_graph_equals_eager():
    args = _case(2, torch.bfloat16, False, torch.int64, torch.bfloat16)
    eager = _op(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _op(*args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _op(*args)
    fresh = _case(2, torch.bfloat16, False, torch.int64, torch.bfloat16, seed=9)
    for dst, src in zip(args, fresh, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _op(*args))
    assert not torch.equal(captured, eager)


def test_calls_outside_the_fused_shape_take_the_planned_block():
    # A width that is not a multiple of 8 and a non-contiguous hidden: the planned block, same result.
    x, ids, w, gate_up, down = _case(2, torch.bfloat16, False, torch.int64, torch.bfloat16)
    wide = torch.zeros((2, 2 * H), dtype=x.dtype, device="cuda")
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    planned = _op(strided, ids, w, gate_up, down)
    ref = _reference(x, ids, w, gate_up, down)
    assert ((planned.double().cpu() - ref).abs() <= 2**-7 * (ref.abs() + 1)).all()
