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
    if tdev == "cpu":
        # Off CUDA the automatic route is the exact rule's choice; bf16 stacks take its bf16-dot
        # form where the CPU backend registers it (bit-identical to direct_bf16_dot).
        if dtype == "bf16" and _cpu_has_bf16_dot():
            want = routemm.moe_experts(x, ids, w, gate_up, down, route="direct_bf16_dot")
        assert torch.equal(_op(x, ids, w, gate_up, down), want)


def _cpu_has_bf16_dot() -> bool:
    registry = routemm.KernelRegistry(routemm.Device("cpu"))
    return all(registry.has_kernel(n) for n in routemm.DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES)


def test_cpu_bf16_stacks_default_to_the_bf16_dot_routes():
    """exact=False on CPU bf16 stacks (batch_invariant too): the bf16-dot routes where the CPU has
    AVX512_BF16 (within their bound of float64, activations rounded to bf16), never for f16/f32
    stacks or exact=True."""
    if not _cpu_has_bf16_dot():
        pytest.skip("this CPU has no AVX512_BF16 (or ROUTEMM_CPU_ISA excludes it)")
    gate_up, down = _float_stacks(torch.bfloat16, False)
    for m in (1, 40):  # the direct and the grouped form
        x, ids, w = _routing(m, invalid=False)
        exact = routemm.moe_experts(x, ids, w, gate_up, down)
        dot = routemm.moe_experts(x, ids, w, gate_up, down, route="direct_bf16_dot")
        assert not torch.equal(dot, exact)  # the shapes tell the two routes apart
        assert torch.equal(_op(x, ids, w, gate_up, down), dot)
        assert torch.equal(_op(x, ids, w, gate_up, down, exact=True), exact)
        # bf16-dot's direct and grouped forms give the same bits: batch-invariant as it is.
        assert torch.equal(_op(x, ids, w, gate_up, down, batch_invariant=True), dot)
        ref = torch.zeros((m, H), dtype=torch.float64)
        g64, d64 = gate_up.double(), down.double()
        for t in range(m):
            for s in range(TOP_K):
                e = int(ids[t, s])
                gu = g64[e] @ x[t].double()
                act = torch.nn.functional.silu(gu[:I]) * gu[I:]
                ref[t] += float(w[t, s]) * (d64[e] @ act)
        rel = float((dot.double() - ref).norm() / ref.norm())
        assert rel < 1e-2, rel
    for dtype in (torch.float16, torch.float32):
        gate_up, down = _float_stacks(dtype, False)
        x, ids, w = _routing(40, invalid=False)
        assert torch.equal(_op(x, ids, w, gate_up, down), routemm.moe_experts(x, ids, w, gate_up, down))


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
        ((x, ids, w, gate_up, down), {"ggml_type": "q3_k"}, "ggml_type must be None or one of 'q4_0', 'q8_0', 'q4_1'"),
        ((x, ids, w, gate_up, down), {"ggml_type": "q4_0"}, "block stacks must be uint8 blocks"),
        ((x[:, :0], ids, w, gate_up, down), {}, r"down must be \[E, 0, I\]"),
    ]
    for args, kw, message in cases:
        with pytest.raises(ValueError, match=message) as from_op:  # either kernel set's op
            torch.ops.routemm.moe_experts(*args, **kw)
        with pytest.raises(routemm.InvalidArgumentError) as from_python:  # the Python kernel itself
            rt._moe_experts(*args, **kw)
        assert str(from_op.value) == str(from_python.value)


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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the side stream's first blocks come from the driver
        _op(x, ids, w, gate_up, down)
    torch.cuda.synchronize()
    routemm.reset_encoder_counters()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
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


# ---- gradients -------------------------------------------------------------------------------------


def _reference_block(x, ids, w, gate_up, down, up=None):
    """The block in float64 autograd ops (the gradients' reference)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if not 0 <= e < E:
                continue
            g = (gate_up[e] if up is not None else gate_up[e, :I]) @ x[t]
            u = (up[e] if up is not None else gate_up[e, I:]) @ x[t]
            out[t] = out[t] + w[t, s] * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def _gradient_case(split: bool):
    (gate_up, down), (x, ids, w) = _float_stacks(torch.float32, split), _routing(9)
    grad_out = torch.randn((9, H), generator=torch.Generator().manual_seed(3))
    stacks = list(gate_up) if split else [gate_up]
    return x, ids, w, stacks, down, grad_out


@pytest.mark.parametrize("split", [False, True], ids=["gate_up", "gate+up"])
def test_gradients_match_a_float64_reference(split):
    x, ids, w, stacks, down, grad_out = _gradient_case(split)
    leaves = [t.clone().requires_grad_() for t in (x, w, *stacks, down)]
    lx, lw, *lstacks, ldown = leaves
    up = lstacks[1] if split else None
    out = torch.ops.routemm.moe_experts(lx, ids, lw, lstacks[0], ldown, up)
    out.backward(grad_out)
    ref_leaves = [t.double().requires_grad_() for t in (x, w, *stacks, down)]
    rx, rw, *rstacks, rdown = ref_leaves
    ref = _reference_block(rx, ids, rw, rstacks[0], rdown, rstacks[1] if split else None)
    ref.backward(grad_out.double())
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(leaves, ref_leaves, strict=True):
        err = float((got.grad.double() - want.grad).abs().max() / want.grad.abs().max())
        assert got.grad.dtype == got.dtype and err <= 1e-5, err


def test_gradients_in_the_model_dtype_and_only_where_asked():
    x, ids, w, (gate_up,), down, grad_out = _gradient_case(False)
    xb = x.bfloat16().requires_grad_()
    gu = gate_up.bfloat16().requires_grad_()
    out = torch.ops.routemm.moe_experts(xb, ids, w.bfloat16(), gu, down.bfloat16())
    assert out.dtype == torch.bfloat16 and out.requires_grad
    out.float().backward(grad_out)
    assert xb.grad.dtype == torch.bfloat16 and gu.grad.dtype == torch.bfloat16
    # Without grad mode the op records nothing.
    with torch.no_grad():
        assert not torch.ops.routemm.moe_experts(xb, ids, w.bfloat16(), gu, down.bfloat16()).requires_grad


@pytest.mark.parametrize("ggml_type", ["q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q4_k", "q5_k", "q6_k"])
def test_block_stacks_give_hidden_and_weights_their_gradients(ggml_type):
    """Frozen block stacks (QLoRA-style): the gradients of hidden and of the routing weights against
    float64 autograd on the dequantised stacks; the stacks, uint8, get none. K = 256 for the
    K-quants, so every format runs at its own block size."""
    from routemm.formats import ggml

    h, i = 256, 512
    rng = np.random.default_rng(list(_GGML_TYPES).index(ggml_type))
    arrays = [rng.standard_normal((E, i, h)) / h**0.5 for _ in range(2)] + [rng.standard_normal((E, h, i)) / i**0.5]
    blocks = [ggml.quantize(a.astype(np.float32), ggml_type) for a in arrays]
    gate, up, down = (torch.from_numpy(ggml.dequantize(b, ggml_type).astype(np.float64)) for b in blocks)
    g = torch.Generator().manual_seed(5)
    x = torch.randn((7, h), generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(7)]).to(torch.int32)
    ids[1, 1], ids[2, 0] = -1, E  # an invalid id and an expert-parallel sentinel
    w = torch.rand((7, TOP_K), generator=g)
    lx, lw = x.clone().requires_grad_(), w.clone().requires_grad_()
    stacks = [torch.from_numpy(b) for b in blocks]
    out = torch.ops.routemm.moe_experts(lx, ids, lw, stacks[0], stacks[2], stacks[1], ggml_type)
    grad_out = torch.randn(out.shape, generator=g)
    out.backward(grad_out)
    rx, rw = x.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.zeros_like(rx)
    for t in range(7):
        for slot in range(TOP_K):
            e = int(ids[t, slot])
            if 0 <= e < E:
                a = torch.nn.functional.silu(gate[e] @ rx[t]) * (up[e] @ rx[t])
                ref = ref.index_add(0, torch.tensor([t]), (rw[t, slot] * (down[e] @ a))[None])
    ref.backward(grad_out.double())
    for got, want in ((lx.grad, rx.grad), (lw.grad, rw.grad)):
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert got.dtype == torch.float32 and err <= 1e-5, (ggml_type, err)
    assert float(lw.grad[1, 1]) == 0.0 and float(lw.grad[2, 0]) == 0.0
    assert all(b.grad is None for b in stacks)


_GGML_TYPES = ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q4_k", "q5_k", "q6_k")


def test_both_kernel_sets_give_the_same_gradients(tmp_path):
    """The Python kernels' autograd kernel (ROUTEMM_TORCH_KERNELS=python, in a child process) and the
    C++ one route a call that needs a gradient through the same backward: the same bits."""
    import subprocess
    import sys

    script = tmp_path / "grads.py"
    script.write_text(
        "import sys, torch, routemm.torch as rt\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import test_torch_moe_experts as T\n"
        "x, ids, w, (gu,), down, g = T._gradient_case(False)\n"
        "leaves = [t.clone().requires_grad_() for t in (x, w, gu, down)]\n"
        "torch.ops.routemm.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3]).backward(g)\n"
        "torch.save([rt.KERNELS] + [t.grad for t in leaves], sys.argv[2])\n"
    )
    here = str(__import__("pathlib").Path(__file__).parent)
    results = {}
    for kernels in ("cpp", "python"):
        path = tmp_path / f"{kernels}.pt"
        env = dict(__import__("os").environ, ROUTEMM_TORCH_KERNELS=kernels)
        done = subprocess.run([sys.executable, str(script), here, str(path)], env=env, capture_output=True, text=True)
        if done.returncode != 0 and kernels == "cpp" and "routemm._torch_ops" in done.stderr:
            pytest.skip("routemm._torch_ops is not built here")
        assert done.returncode == 0, done.stderr[-2000:]
        results[kernels] = torch.load(path)
    assert results["cpp"][0] == "cpp" and results["python"][0] == "python"
    for a, b in zip(results["cpp"][1:], results["python"][1:], strict=True):
        assert torch.equal(a, b)
