"""The CUDA kernels of the GGML block formats beyond Q4_0 / Q8_0 (Q4_1, Q5_0, Q5_1, MXFP4, Q4_K,
Q5_K, Q6_K) against the CPU backend, bit for bit: both run the lane contract on the exact weights
(ggml_formats.h), so the expert-ID direct and grouped routes and the dense mat-vec and matrix routes
must give the CPU's bits. Cases cover tails (n not a multiple of the 16-column tile, K ending in a
partial shared-memory stage, m = 1, 7, 33), expert strides and views at odd byte offsets (the
byte-wise staging path) and 16-byte aligned ones (the sm_90a bulk-copy path of the direct route,
also checked against its load path in a separate process), both input layouts, poisoned outputs
(every element written) and sentinel ids (zero rows).

Runs where the tested backends include cuda (ROUTEMM_TEST_BACKENDS=cuda on a GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DType, GgmlType, _core
from routemm import GgmlQuantizedMatmulIdRoute as Route
from support import POISON_U32, distinct_ids, guarded, guarded_output, run_ggml_guarded, sprinkle_invalid

# (name, GgmlType code, block values, block bytes, mat-vec, matrix, id direct, id grouped)
KERNEL_FORMATS = {f[0]: f for f in getattr(_core, "GGML_KERNEL_FORMATS", ())}
TYPES = [GgmlType(name) for name in KERNEL_FORMATS]
# Offsets of each format's binary16 fields (scales and mins) in one block.
HALF_FIELDS = {
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "mxfp4": (),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}


@pytest.fixture
def cuda(backend):
    if backend != "cuda":
        pytest.skip("CUDA kernels: runs on the cuda backend only")
    return routemm.Device("cuda")


@pytest.fixture(scope="module")
def cpu():
    return routemm.Device("cpu")


def needs(device, *names):
    registry = routemm.KernelRegistry(device)
    missing = [name for name in names if not registry.has_kernel(name)]
    if missing:
        pytest.skip(f"no {', '.join(missing)} on {device.backend}")
    return registry


def random_blocks(rng, name, rows, k):
    """[rows, k / values * bytes] random blocks: every code byte random, binary16 fields random finite
    scales of either sign (some subnormal), MXFP4 exponents around 2^0 (and the subnormal 0 and 1)."""
    _, _, values, block_bytes, *_ = KERNEL_FORMATS[name]
    blocks = rng.integers(0, 256, (rows, k // values, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[name]:
        d = rng.uniform(2e-3, 2e-2, blocks.shape[:-1]) * rng.choice([-1.0, 1.0], blocks.shape[:-1])
        d[rng.random(d.shape) < 0.05] = 3e-6  # a binary16 subnormal
        halves = d.astype(np.float16)
        blocks[..., offset : offset + 2] = halves[..., None].view(np.uint8).reshape(*halves.shape, 2)
    if name == "mxfp4":
        e = rng.integers(118, 136, blocks.shape[:-1])
        e[rng.random(e.shape) < 0.05] = 1
        e[rng.random(e.shape) < 0.05] = 0
        blocks[..., 0] = e
    return blocks.reshape(rows, -1)


def stack_bytes(blocks, n_experts, pad):
    """n_experts matrices of `blocks` [n_experts * n, row bytes] with `pad` bytes between them."""
    matrix = blocks.size // n_experts
    stride = matrix + pad
    data = np.full((n_experts - 1) * stride + matrix, 0xD7, np.uint8)
    flat = blocks.reshape(n_experts, -1)
    for e in range(n_experts):
        data[e * stride : e * stride + matrix] = flat[e]
    return data, stride


def run_id(device, registry, ggml_type, route, data, stride, x, ids, n, n_experts, slotted, weight_guard):
    m, top_k = ids.shape
    k = x.shape[-1]
    w = guarded(device, data, DType.U8, (data.size,), guard=np.full(weight_guard, 0xD7, np.uint8))
    xb = guarded(device, x, DType.F32, x.shape)
    ib = guarded(device, ids, DType.U32, ids.shape)
    out = guarded_output(device, m * top_k, n)
    layout = Layout.SLOTTED if slotted else Layout.SHARED_PER_TOKEN
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, n_experts, ggml_type, stride, layout, route)
    scratch = routemm.DenseMatmulIdScratch(device, n_experts, m) if route.is_grouped else None
    encoder = device.command_encoder()
    routemm.quantized_matmul_id_ggml(encoder, registry, xb.view, w.view, ib.view, out.view, scratch, params)
    encoder.commit_and_wait()
    for guarded_input, what in ((w, "weights"), (xb, "input"), (ib, "ids")):
        guarded_input.assert_unchanged(what)
    out.assert_guards_intact("output")
    got = out.view.numpy().reshape(m * top_k, n).copy()
    assert not np.any(got.view(np.uint32) == POISON_U32), "an output element was never written"
    return got


def k_of(name, blocks):
    return blocks * KERNEL_FORMATS[name][2]


# (m, top_k, n, blocks per row, n_experts, pad, weight guard, slotted): tails and paths.
ID_CASES = {
    # one decode token; rows of 41 / 5 blocks end in a partial stage; odd stride and view
    "decode_tail_odd": (1, 8, 70, None, 16, 3, 3, False),
    # 16-byte aligned rows and stride (64 blocks of 32 values, 8 super-blocks): the bulk path
    "decode_aligned": (1, 4, 48, "aligned", 8, 0, 16, False),
    "m7_slotted": (7, 3, 33, None, 6, 1, 16, True),
    "m33_odd": (33, 4, 70, None, 8, 5, 1, False),
}


def blocks_per_row(name, spec):
    values = KERNEL_FORMATS[name][2]
    if spec == "aligned":
        return 64 if values == 32 else 8
    return 41 if values == 32 else 5  # 32 + 9 blocks, 4 + 1 super-blocks: a partial last stage


@pytest.mark.parametrize("case", list(ID_CASES))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_expert_id_routes_equal_the_cpu_bit_for_bit(cuda, cpu, rng, ggml_type, case):
    name = ggml_type.value
    _, _, _, _, _, _, direct, grouped = KERNEL_FORMATS[name]
    map_name = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3]
    reg_cuda = needs(cuda, direct, grouped, map_name)
    reg_cpu = needs(cpu, direct, grouped, map_name)
    m, top_k, n, spec, n_experts, pad, weight_guard, slotted = ID_CASES[case]
    k = k_of(name, blocks_per_row(name, spec))
    blocks = random_blocks(rng, name, n_experts * n, k)
    data, stride = stack_bytes(blocks, n_experts, pad)
    x = rng.standard_normal((m * top_k if slotted else m, k)).astype(np.float32)
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts), n_experts, fraction=0.2)
    ids[0, -1] = 0xFFFFFFFF  # a sentinel id in every case
    for route in (Route.DIRECT, Route.GROUPED):
        args = (ggml_type, route, data, stride, x, ids, n, n_experts, slotted, weight_guard)
        got = run_id(cuda, reg_cuda, *args)
        want = run_id(cpu, reg_cpu, *args)
        invalid = ids.reshape(-1) >= n_experts
        assert np.all(got[invalid].view(np.uint32) == 0), "an invalid id's row is not +0.0"
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{route.value}")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_expert_id_grouped_with_ids_repeated_within_a_token(cuda, cpu, rng, ggml_type):
    """An expert holding more than m routed rows (ids repeat within tokens): the grouped block loops
    over its segment."""
    name = ggml_type.value
    _, _, _, _, _, _, direct, grouped = KERNEL_FORMATS[name]
    reg_cuda = needs(cuda, grouped)
    reg_cpu = needs(cpu, grouped)
    m, top_k, n, n_experts = 9, 3, 24, 4
    k = k_of(name, 2)
    blocks = random_blocks(rng, name, n_experts * n, k)
    data, stride = stack_bytes(blocks, n_experts, 0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = rng.integers(0, n_experts, (m, top_k)).astype(np.uint32)
    args = (ggml_type, Route.GROUPED, data, stride, x, ids, n, n_experts, False, 16)
    np.testing.assert_array_equal(
        run_id(cuda, reg_cuda, *args).view(np.uint32), run_id(cpu, reg_cpu, *args).view(np.uint32)
    )


@pytest.mark.parametrize("weight_guard", [16, 3], ids=["aligned", "odd_view"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_dense_routes_equal_the_cpu_bit_for_bit(cuda, cpu, rng, ggml_type, weight_guard):
    name = ggml_type.value
    _, _, _, _, mat_vec, matrix, *_ = KERNEL_FORMATS[name]
    reg_cuda = needs(cuda, mat_vec, matrix)
    reg_cpu = needs(cpu, mat_vec, matrix)
    n = 70
    for spec in (None, "aligned"):
        k = k_of(name, blocks_per_row(name, spec))
        blocks = random_blocks(rng, name, n, k)
        x = rng.standard_normal((33, k)).astype(np.float32)
        for m in (1, 2, 7, 33):
            got, receipt = run_ggml_guarded(cuda, reg_cuda, ggml_type, blocks, x[:m], n, weight_guard=weight_guard)
            want, _ = run_ggml_guarded(cpu, reg_cpu, ggml_type, blocks, x[:m], n, weight_guard=weight_guard)
            assert receipt.pipeline_label.startswith(mat_vec if m <= 8 else matrix)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"m={m} k={k}")


_LOAD_PATH_SCRIPT = """
    import sys
    import numpy as np, routemm
    from routemm import DenseMatmulIdInputLayout as Layout, GgmlType
    device = routemm.Device(sys.argv[1])
    registry = routemm.KernelRegistry(device)
    data = np.load(sys.argv[2])
    outputs = {}
    for name in data["names"]:
        blocks, x, ids = data[name + "/w"], data[name + "/x"], data[name + "/ids"]
        n_experts, n, k = (int(v) for v in data[name + "/shape"])
        params = routemm.GgmlQuantizedMatmulIdParams(
            x.shape[0], n, k, ids.shape[1], n_experts, GgmlType(str(name)), blocks.size // n_experts,
            Layout.SHARED_PER_TOKEN, routemm.GgmlQuantizedMatmulIdRoute.DIRECT)
        out = device.alloc(ids.size * n * 4, routemm.DType.F32, [ids.size, n])
        encoder = device.command_encoder()
        routemm.quantized_matmul_id_ggml(encoder, registry, device.from_numpy(x), device.from_numpy(blocks),
                                         device.from_numpy(ids), out, None, params)
        encoder.commit_and_wait()
        outputs[str(name)] = out.numpy()
    np.savez(sys.argv[3], **outputs)
"""


@pytest.mark.parametrize("spec", ["aligned", "odd"])
def test_direct_bulk_and_load_paths_equal_the_cpu(cuda, rng, tmp_path, spec):
    """The direct route's two data paths (bulk copies of the 16-byte units around each row's
    stage on sm_90a; the threads' loads with ROUTEMM_CUDA_DIRECT_PATH=loads) give the CPU's bits,
    with 16-byte aligned rows and with rows that start anywhere in a unit ("odd": 41 blocks or 5
    super-blocks per row, a partial last stage)."""
    needs(cuda, *(KERNEL_FORMATS[t.value][6] for t in TYPES))
    inputs = {"names": np.array([t.value for t in TYPES])}
    for t in TYPES:
        n_experts, n, k = 8, 40, k_of(t.value, blocks_per_row(t.value, spec) * 3)  # stage refills
        inputs[t.value + "/w"] = random_blocks(rng, t.value, n_experts * n, k).reshape(-1)
        inputs[t.value + "/x"] = rng.standard_normal((2, k)).astype(np.float32)
        inputs[t.value + "/ids"] = sprinkle_invalid(rng, distinct_ids(rng, 2, 4, n_experts), n_experts)
        inputs[t.value + "/shape"] = np.array([n_experts, n, k])
    np.savez(tmp_path / "in.npz", **inputs)
    results = {}
    for label, backend, path in (("cpu", "cpu", None), ("bulk", "cuda", None), ("loads", "cuda", "loads")):
        env = {k: v for k, v in os.environ.items() if k != "ROUTEMM_CUDA_DIRECT_PATH"}
        if path is not None:
            env["ROUTEMM_CUDA_DIRECT_PATH"] = path
        out = tmp_path / f"{label}.npz"
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_LOAD_PATH_SCRIPT), backend, str(tmp_path / "in.npz"), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        with np.load(out) as data:
            results[label] = {name: data[name] for name in data.files}
    for name, want in results["cpu"].items():
        for label in ("bulk", "loads"):
            np.testing.assert_array_equal(
                results[label][name].view(np.uint32), want.view(np.uint32), err_msg=f"{name} {label}"
            )


# ---- The tensor-core route (grouped_tensor_lowp) --------------------------------------------------

# Byte ranges of the codes in one block of the formats with a min (value = d * q + m): with them
# zeroed the dequantiser gives m alone, the min term the route adds separately.
CODE_BYTES = {"q4_1": (4, 20), "q5_1": (4, 24), "q4_k": (16, 144), "q5_k": (16, 176)}


def mins_of(blocks, name, k):
    """|m| per weight value (zeros for the formats without a min)."""
    if name not in CODE_BYTES:
        return np.zeros((*blocks.shape[:-1], k), np.float64)
    block_bytes = KERNEL_FORMATS[name][3]
    raw = blocks.reshape(*blocks.shape[:-1], -1, block_bytes).copy()
    lo, hi = CODE_BYTES[name]
    raw[..., lo:hi] = 0
    return np.abs(routemm.dequantize(raw.reshape(blocks.shape), GgmlType(name), (*blocks.shape[:-1], k)))


def lowp_pipeline(name):
    return f"quantized_matmul_id_grouped_lowp_{name}_f32"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_lowp_route_is_offered_for_every_kernel_format(ggml_type):
    """grouped_tensor_lowp takes every kernel format (the grouped route's extents and scratch); the
    int8-dot routes are Q4_0's, Q8_0's and the K-quants' only."""
    name = ggml_type.value
    _, _, values, block_bytes, *_ = KERNEL_FORMATS[name]
    k = 2 * 256
    stride = 70 * k // values * block_bytes
    params = routemm.GgmlQuantizedMatmulIdParams(
        9, 70, k, 4, 8, ggml_type, stride, Layout.SLOTTED, Route.GROUPED_TENSOR_LOWP
    )
    cap = routemm.quantized_matmul_id_ggml_capability(params)
    grouped = routemm.quantized_matmul_id_ggml_capability(
        routemm.GgmlQuantizedMatmulIdParams(9, 70, k, 4, 8, ggml_type, stride, Layout.SLOTTED, Route.GROUPED)
    )
    assert cap.route is Route.GROUPED_TENSOR_LOWP and cap.scratch == grouped.scratch
    assert cap.required_weight_bytes == grouped.required_weight_bytes
    map_name = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3]
    assert Route.GROUPED_TENSOR_LOWP.pipelines(ggml_type) == (map_name, lowp_pipeline(name))
    assert lowp_pipeline(name) in routemm.GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES
    for route in (Route.DIRECT_INT8_DOT, Route.GROUPED_INT8_DOT):
        if name in ("q4_k", "q5_k", "q6_k"):
            assert route.pipelines(ggml_type)[-1] == f"quantized_matmul_id_{route.value[:-9]}_int8dot_{name}_f32"
            continue
        with pytest.raises(routemm.InvalidArgumentError, match=f"route {route.value} supports .* only, not {name}"):
            route.pipelines(ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_lowp_route_without_its_pipeline_is_refused_before_encoding(device, registry, rng, ggml_type):
    name = ggml_type.value
    if registry.has_kernel(lowp_pipeline(name)):
        pytest.skip(f"{device.backend} registers {lowp_pipeline(name)}")
    assert device.backend != "cuda", "CUDA registers the tensor route of every kernel format"
    k = k_of(name, 1)
    data, stride = stack_bytes(random_blocks(rng, name, 3 * 8, k), 3, 0)
    x = rng.standard_normal((2, k)).astype(np.float32)
    ids = distinct_ids(rng, 2, 2, 3)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.KernelNotFoundError, match=lowp_pipeline(name)):
        run_id(device, registry, ggml_type, Route.GROUPED_TENSOR_LOWP, data, stride, x, ids, 8, 3, False, 16)
    assert routemm.dispatch_count() == before, "a refused call must dispatch nothing"


@pytest.mark.parametrize("exact_inputs", [False, True], ids=["normal", "exact_inputs"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_lowp_route_meets_its_bound(cuda, rng, ggml_type, exact_inputs):
    """Against float64 on the dequantised weights: each element within 2^-10 * sum((|w| + 2|m|) |x|)
    (the activations' rounding to f16, 2^-11 relative, and F32 sums of d * sum(q x) and m * sum(x),
    |d q| <= |w| + |m|), the relative Frobenius error within the route's 1e-2; with activations in
    {-1, 0, 1} (exact in f16) only the F32 sums remain: within K * 2^-22 of the same magnitude.
    Tiles past n, more routed rows than one tile, sentinel ids, odd expert strides."""
    name = ggml_type.value
    reg = needs(cuda, lowp_pipeline(name), routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3])
    m, top_k, n, n_experts = 40, 4, 150, 6
    k = k_of(name, blocks_per_row(name, None))
    blocks = random_blocks(rng, name, n_experts * n, k)
    data, stride = stack_bytes(blocks, n_experts, 3)
    if exact_inputs:
        x = rng.integers(-1, 2, (m, k)).astype(np.float32)
    else:
        x = rng.standard_normal((m, k)).astype(np.float32)
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts), n_experts, fraction=0.1)
    got = run_id(cuda, reg, ggml_type, Route.GROUPED_TENSOR_LOWP, data, stride, x, ids, n, n_experts, False, 16)
    w = routemm.dequantize(blocks, ggml_type, (n_experts * n, k)).astype(np.float64).reshape(n_experts, n, k)
    mins = mins_of(blocks, name, k).reshape(n_experts, n, k)
    flat = ids.reshape(-1)
    invalid = flat >= n_experts
    assert np.all(got[invalid].view(np.uint32) == 0)
    valid = np.flatnonzero(~invalid)
    xs = x.astype(np.float64)[valid // top_k]
    ref = np.einsum("rk,rnk->rn", xs, w[flat[valid]])
    mag = np.einsum("rk,rnk->rn", np.abs(xs), np.abs(w[flat[valid]]) + 2 * mins[flat[valid]])
    err = np.abs(got[valid].astype(np.float64) - ref)
    limit = k * 2.0**-22 if exact_inputs else 2.0**-10
    assert np.all(err <= limit * mag + 1e-30), f"max error / magnitude {np.max(err / (mag + 1e-30))}"
    assert np.linalg.norm(got[valid] - ref) <= 1e-2 * np.linalg.norm(ref)
