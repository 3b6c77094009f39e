"""The kernels of the GGML block formats beyond Q4_0 / Q8_0 (Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K,
Q6_K): the dense mat-vec and matrix routes of quantized_matmul_ggml and the expert-ID direct and
grouped routes of quantized_matmul_id_ggml, against a float64 reference on the dequantised weights
(the F32 accumulation bound), bit for bit against each other where the lane contract makes them
equal (dense mat-vec == matrix rows == direct == grouped), and the CPU's instruction-set clones
against each other. Tails (m = 1, 7, 33; n not a multiple of the 64-column tile), poisoned outputs
fully written, sentinel ids, refusals.

A backend without a format's pipelines (metal_emu, until its shaders exist) skips."""

from __future__ import annotations

import json
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
from support import PAD_BYTE, distinct_ids, guarded, guarded_output, reference, run_ggml_guarded, sprinkle_invalid

# (name, GgmlType code, block values, block bytes, mat-vec, matrix, id direct, id grouped)
KERNEL_FORMATS = {f[0]: f for f in _core.GGML_KERNEL_FORMATS}
TYPES = [GgmlType(name) for name in KERNEL_FORMATS]
# Accumulation bound against the float64 reference: F32 FMA chains over K, plus the lane tree.
REL = 2.0**-20
N = 70  # not a multiple of the 64-column item nor of the 8-output mat-vec threadgroup
HAS_QUANTIZER = {name: has for name, _, _, has in _core.GGML_FORMATS}
# Backends whose matrix routes (the dense simdgroup route, the grouped expert-ID route) sum in the
# mat-vec's lane order, so that every route gives the same bits. Metal's multiply on simdgroup
# matrices, whose summation order the hardware does not specify: the accumulation bound there.
LANE_ORDER_EVERYWHERE = ("cpu",)
# Backends whose expert-ID direct route is the dense mat-vec's lane contract (equal bit for bit).
DIRECT_EQUALS_MAT_VEC = ("cpu", "metal", "metal_emu")


def test_every_table_format_but_q4_0_and_q8_0_has_kernels():
    table = {name for name, *_ in _core.GGML_FORMATS}
    assert set(KERNEL_FORMATS) == table - {"q4_0", "q8_0"}
    for name, code, values, block_bytes, *pipelines in _core.GGML_KERNEL_FORMATS:
        assert list(GgmlType).index(GgmlType(name)) == code
        assert routemm.formats.ggml.block_format(name).block_values == values
        assert routemm.formats.ggml.block_format(name).block_bytes == block_bytes
        assert pipelines == [
            f"kernel_mul_mv_{name}_f32",
            f"kernel_mul_mm_{name}_f32",
            f"quantized_matmul_id_direct_{name}_f32",
            f"quantized_matmul_id_grouped_{name}_f32",
        ]


def block_k(ggml_type) -> int:
    """A width of two blocks (K-quants) or sixteen (32-value formats): 512 either way."""
    return 512


def random_blocks(rng, ggml_type, shape):
    """Blocks of `shape` [..., k] of random weights: quantised by routemm.quantize where the format
    has a reference quantiser, else random codes under small positive binary16 scales."""
    name = GgmlType(ggml_type).value
    if HAS_QUANTIZER[name]:
        return routemm.quantize(rng.uniform(-1.0, 1.0, shape).astype(np.float32), ggml_type)
    _, _, values, block_bytes, *_ = KERNEL_FORMATS[name]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // values, block_bytes), dtype=np.uint8)
    scales = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[name]
    for offset in scales:
        d = rng.uniform(2e-3, 2e-2, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset : offset + 2] = d[..., None].view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(*shape[:-1], -1)


def dequantized(blocks, ggml_type, k):
    return routemm.dequantize(blocks, ggml_type, (*blocks.shape[:-1], k))


# metal_emu runs the shaders on the CPU, slowly: there every format runs at one size and the tails
# (m = 1, 33) and the experts block run for one 32-value format and one K-quant.
EMU_TAIL_TYPES = (GgmlType.Q5_1, GgmlType.Q4_K)


def emu_subset(device, ggml_type, m=7):
    if device.backend == "metal_emu" and ggml_type not in EMU_TAIL_TYPES and m != 7:
        what = "the experts block" if m is None else f"m = {m}"
        pytest.skip(f"metal_emu runs {what} for {', '.join(t.value for t in EMU_TAIL_TYPES)} only (slow)")


def needs(registry, *names):
    missing = [name for name in names if not registry.has_kernel(name)]
    if missing:
        pytest.skip(f"no {', '.join(missing)} on this backend")


def assert_bound(got, ref, mag, k):
    assert np.all(np.isfinite(got)), "poison or a non-finite value left in the output"
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= REL * mag * k**0.5 + 1e-30), f"max error {err.max()}"


# ---- Dense --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_dense_routes_meet_the_reference_and_agree_bit_for_bit(device, registry, rng, ggml_type):
    _, _, _, _, mat_vec, matrix, *_ = KERNEL_FORMATS[ggml_type.value]
    needs(registry, mat_vec, matrix)
    k = block_k(ggml_type)
    blocks = random_blocks(rng, ggml_type, (N, k))
    w = dequantized(blocks, ggml_type, k).astype(np.float64)
    x33 = rng.uniform(-1.0, 1.0, (33, k)).astype(np.float32)
    rows = {}
    for m in (1, 7, 33):
        x = x33[:m]
        got, receipt = run_ggml_guarded(device, registry, ggml_type, blocks, x, N)
        assert receipt.ggml_type == ggml_type
        assert receipt.pipeline_label.startswith(mat_vec if m <= 8 else matrix)
        assert receipt.route == ("mat_vec" if m <= 8 else "compatibility_simdgroup")
        prod = x.astype(np.float64)[:, None, :] * w[None, :, :]
        assert_bound(got, prod.sum(axis=2), np.abs(prod).sum(axis=2), k)
        rows[m] = got
    # Each output's operations do not depend on m: the mat-vec's rows agree exactly, and on
    # LANE_ORDER_EVERYWHERE backends the matrix route's too.
    np.testing.assert_array_equal(rows[7][:1].view(np.uint32), rows[1].view(np.uint32))
    if device.backend in LANE_ORDER_EVERYWHERE:
        np.testing.assert_array_equal(rows[33][:7].view(np.uint32), rows[7].view(np.uint32))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_kernels_decode_weights_as_ggml_does(device, registry, rng, ggml_type):
    """Identity activations (m = k = 256, the matrix route) make every output one weight times 1
    plus products with 0, all exact: the kernels' weights are routemm.dequantize's (ggml's
    to_float) value for value, whatever the summation order."""
    _, _, _, _, _, matrix, *_ = KERNEL_FORMATS[ggml_type.value]
    needs(registry, matrix)
    k, n = 256, 16
    blocks = random_blocks(rng, ggml_type, (n, k))
    got, _ = run_ggml_guarded(device, registry, ggml_type, blocks, np.eye(k, dtype=np.float32), n)
    np.testing.assert_array_equal(got.T, dequantized(blocks, ggml_type, k))


@pytest.mark.parametrize(
    "ggml_type", [t for t in TYPES if t not in (GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K)], ids=lambda t: t.value
)
def test_dense_int8_dot_policy_runs_the_exact_routes(device, registry, rng, ggml_type):
    """The int8-dot pipelines exist for Q4_0, Q8_0 and the K-quants only (test_kquant_int8_dot.py):
    the policy leaves these formats exact."""
    _, _, _, _, mat_vec, *_ = KERNEL_FORMATS[ggml_type.value]
    needs(registry, mat_vec)
    k = block_k(ggml_type)
    blocks = random_blocks(rng, ggml_type, (N, k))
    x = rng.uniform(-1.0, 1.0, (2, k)).astype(np.float32)
    exact, _ = run_ggml_guarded(device, registry, ggml_type, blocks, x, N)
    got, receipt = run_ggml_guarded(
        device, registry, ggml_type, blocks, x, N, routemm.GgmlRoutingPolicy(dense_int8_dot=True)
    )
    assert receipt.route == "mat_vec" and receipt.pipeline_label.startswith(mat_vec)
    np.testing.assert_array_equal(got.view(np.uint32), exact.view(np.uint32))


# ---- Expert-ID ----------------------------------------------------------------------------------


def stack_of(rng, ggml_type, n_experts, n, k, pad):
    """(stack bytes with `pad` bytes of PAD_BYTE between experts, stride, dequantised weights)."""
    blocks = random_blocks(rng, ggml_type, (n_experts, n, k))
    matrix = blocks[0].nbytes
    stride = matrix + pad
    data = np.full((n_experts - 1) * stride + matrix, PAD_BYTE, np.uint8)
    for e in range(n_experts):
        data[e * stride : e * stride + matrix] = blocks[e].reshape(-1)
    return data, stride, dequantized(blocks, ggml_type, k), blocks


def run_id(device, registry, ggml_type, route, weights, stride, x, ids, n, n_experts, slotted):
    m, top_k = ids.shape
    k = x.shape[-1]
    w = guarded(device, weights, DType.U8, (weights.size,))
    xb = guarded(device, x, DType.F32, x.shape)
    ib = guarded(device, ids, DType.U32, ids.shape)
    out = guarded_output(device, m * top_k, n)
    layout = Layout.SLOTTED if slotted else Layout.SHARED_PER_TOKEN
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, n_experts, ggml_type, stride, layout, route)
    scratch = routemm.DenseMatmulIdScratch(device, n_experts, m) if route.is_grouped else None
    encoder = device.command_encoder()
    receipt = routemm.quantized_matmul_id_ggml(encoder, registry, xb.view, w.view, ib.view, out.view, scratch, params)
    encoder.commit_and_wait()
    for guarded_input, what in ((w, "weights"), (xb, "input"), (ib, "ids")):
        guarded_input.assert_unchanged(what)
    out.assert_guards_intact("output")
    assert receipt.ggml_type == ggml_type and receipt.route == route
    return out.view.numpy().reshape(m * top_k, n).copy()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_expert_id_routes_meet_the_reference_and_agree_bit_for_bit(device, registry, rng, ggml_type, m):
    emu_subset(device, ggml_type, m)
    _, _, _, _, mat_vec, _, direct, grouped = KERNEL_FORMATS[ggml_type.value]
    needs(registry, direct, grouped, mat_vec, routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3])
    n_experts, top_k, k = 5, 2, block_k(ggml_type)
    # An odd padding: blocks of these formats are read bytewise, at any offset.
    data, stride, deq, blocks = stack_of(rng, ggml_type, n_experts, N, k, pad=3)
    x = rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32)
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts), n_experts, fraction=0.3)
    ids[0, 0] = 0xFFFFFFFF  # a sentinel id in every case
    outs = {}
    for route in (Route.DIRECT, Route.GROUPED):
        got = run_id(device, registry, ggml_type, route, data, stride, x, ids, N, n_experts, False)
        ref, mag = reference(deq, x, ids, False)
        assert_bound(got, ref, mag, k)
        invalid = ids.reshape(-1).astype(np.int64) >= n_experts
        assert np.all(got[invalid] == 0) and not np.any(np.signbit(got[invalid]))
        outs[route] = got
    if device.backend in LANE_ORDER_EVERYWHERE:
        np.testing.assert_array_equal(outs[Route.GROUPED].view(np.uint32), outs[Route.DIRECT].view(np.uint32))
    if device.backend not in DIRECT_EQUALS_MAT_VEC:
        return
    # Each valid routed row equals the dense mat-vec of its expert, bit for bit.
    flat = ids.reshape(-1)
    for f in np.flatnonzero(flat < n_experts)[:3]:
        dense, _ = run_ggml_guarded(device, registry, ggml_type, blocks[flat[f]], x[f // top_k][None], N)
        np.testing.assert_array_equal(outs[Route.DIRECT][f].view(np.uint32), dense[0].view(np.uint32))


@pytest.mark.parametrize("ggml_type", [GgmlType.Q5_1, GgmlType.MXFP4, GgmlType.Q6_K], ids=lambda t: t.value)
def test_expert_id_slotted_input(device, registry, rng, ggml_type):
    _, _, _, _, _, _, direct, grouped = KERNEL_FORMATS[ggml_type.value]
    needs(registry, direct, grouped)
    n_experts, top_k, m, k = 4, 3, 5, block_k(ggml_type)
    data, stride, deq, _ = stack_of(rng, ggml_type, n_experts, 9, k, pad=0)
    x = rng.uniform(-1.0, 1.0, (m, top_k, k)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, n_experts)
    ref, mag = reference(deq, x, ids, True)
    got = {
        r: run_id(device, registry, ggml_type, r, data, stride, x, ids, 9, n_experts, True)
        for r in Route
        if r in (Route.DIRECT, Route.GROUPED)
    }
    assert_bound(got[Route.DIRECT], ref, mag, k)
    assert_bound(got[Route.GROUPED], ref, mag, k)
    if device.backend in LANE_ORDER_EVERYWHERE:
        np.testing.assert_array_equal(got[Route.GROUPED].view(np.uint32), got[Route.DIRECT].view(np.uint32))


def test_matmul_id_takes_every_kernel_format(device, rng):
    for ggml_type in TYPES:
        k = block_k(ggml_type)
        blocks = random_blocks(rng, ggml_type, (3, 6, k))
        x = rng.uniform(-1.0, 1.0, (4, k)).astype(np.float32)
        ids = distinct_ids(rng, 4, 2, 3)
        registry = routemm.KernelRegistry(device)
        if not registry.has_kernel(KERNEL_FORMATS[ggml_type.value][6]):
            pytest.skip(f"no {ggml_type.value} kernels on {device.backend}")
        got = routemm.matmul_id(blocks, x, ids, ggml_type=ggml_type, route="direct", device=device)
        ref, mag = reference(dequantized(blocks, ggml_type, k), x, ids, False)
        assert_bound(np.asarray(got).reshape(ref.shape), ref, mag, k)


# ---- Refusals -----------------------------------------------------------------------------------

UNSUPPORTED = [GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.IQ4_NL, GgmlType.IQ4_XS]


@pytest.mark.parametrize("ggml_type", UNSUPPORTED, ids=lambda t: t.value)
def test_formats_without_kernels_are_refused_by_name(ggml_type):
    params = routemm.GgmlQuantizedMatmulIdParams(1, 8, 256, 1, 2, ggml_type, 8 * 256, Layout.SHARED_PER_TOKEN)
    with pytest.raises(routemm.InvalidArgumentError, match=f"does not support {ggml_type.value}.*q6_k"):
        routemm.quantized_matmul_id_ggml_capability(params)
    with pytest.raises(routemm.InvalidArgumentError, match=f"does not support {ggml_type.value}"):
        routemm.matmul_id(
            np.zeros((2, 8, 144), np.uint8),
            np.zeros((1, 256), np.float32),
            np.zeros((1, 1), np.uint32),
            ggml_type=ggml_type,
        )


def test_dense_refusals_name_the_type_and_k(device, registry):
    out = device.alloc(8 * 4, DType.F32, [1, 8])
    x = device.from_numpy(np.zeros((1, 256), np.float32))
    w = device.from_numpy(np.zeros(8 * 144, np.uint8))
    encoder = device.command_encoder()
    for ggml_type in UNSUPPORTED:
        with pytest.raises(
            routemm.InvalidArgumentError, match=f"quantized_matmul_ggml does not support {ggml_type.value}"
        ):
            routemm.quantized_matmul_ggml(
                encoder, registry, x, w, out, routemm.GgmlQuantizedMatmulParams(1, 8, 256, ggml_type)
            )
    with pytest.raises(routemm.InvalidArgumentError, match=r"K \(96\) must be divisible by block QK \(256\)"):
        routemm.quantized_matmul_ggml(
            encoder, registry, x, w, out, routemm.GgmlQuantizedMatmulParams(1, 8, 96, GgmlType.Q4_K)
        )
    assert encoder.dispatch_count == 0 if hasattr(encoder, "dispatch_count") else True


def test_expert_id_refusals_name_the_route_and_k():
    base = dict(m=1, n=8, top_k=1, n_experts=2, input_layout=Layout.SHARED_PER_TOKEN)
    with pytest.raises(routemm.InvalidArgumentError, match=r"K \(288\) must be divisible by block QK \(256\)"):
        routemm.quantized_matmul_id_ggml_capability(
            routemm.GgmlQuantizedMatmulIdParams(k=288, ggml_type=GgmlType.Q5_K, expert_stride_bytes=8 * 176 * 2, **base)
        )
    for route in (Route.DIRECT_INT8_DOT, Route.GROUPED_INT8_DOT):
        with pytest.raises(
            routemm.InvalidArgumentError,
            match=f"route {route.value} supports q4_0, q8_0, q4_k, q5_k and q6_k only, not q4_1",
        ):
            routemm.quantized_matmul_id_ggml_capability(
                routemm.GgmlQuantizedMatmulIdParams(
                    k=32, ggml_type=GgmlType.Q4_1, expert_stride_bytes=160, route=route, **base
                )
            )
        with pytest.raises(routemm.InvalidArgumentError, match=f"route {route.value} supports .* only, not q4_1"):
            route.pipelines(GgmlType.Q4_1)
    # MXFP4 blocks are 17 bytes: an odd expert stride is a valid packed stack.
    cap = routemm.quantized_matmul_id_ggml_capability(
        routemm.GgmlQuantizedMatmulIdParams(k=32, ggml_type=GgmlType.MXFP4, expert_stride_bytes=8 * 17 + 1, **base)
    )
    assert cap.required_weight_bytes == 8 * 17 + 1 + 8 * 17


# ---- Instruction-set clones ---------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import routemm
    from routemm import DType, GgmlType, _core
    from routemm import DenseMatmulIdInputLayout as Layout
    from routemm import GgmlQuantizedMatmulIdRoute as Route

    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(20261207)
    has_quantizer = {name: has for name, _, _, has in _core.GGML_FORMATS}
    outputs = {}

    def blocks_of(name, values, block_bytes, shape):
        if has_quantizer[name]:
            return routemm.quantize(rng.uniform(-1, 1, shape).astype(np.float32), name)
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // values, block_bytes), dtype=np.uint8)
        for offset in {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[name]:
            d = rng.uniform(2e-3, 2e-2, raw.shape[:-1]).astype(np.float16)
            raw[..., offset : offset + 2] = d[..., None].view(np.uint8).reshape(*d.shape, 2)
        return raw.reshape(*shape[:-1], -1)

    for name, _, values, block_bytes, *_ in _core.GGML_KERNEL_FORMATS:
        k, n = 512, 70
        w = blocks_of(name, values, block_bytes, (n, k))
        for m in (1, 7, 33):
            x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
            out = device.alloc(m * n * 4, DType.F32, [m, n])
            encoder = device.command_encoder()
            routemm.quantized_matmul_ggml(
                encoder, registry, device.from_numpy(x), device.from_numpy(w), out,
                routemm.GgmlQuantizedMatmulParams(m, n, k, GgmlType(name)),
            )
            encoder.commit_and_wait()
            outputs[f"{name}/dense/m{m}"] = out.numpy()
        stack = blocks_of(name, values, block_bytes, (4, n, k))
        x = rng.uniform(-1, 1, (9, k)).astype(np.float32)
        ids = np.stack([rng.permutation(4)[:2] for _ in range(9)]).astype(np.uint32)
        for route in (Route.DIRECT, Route.GROUPED):
            out = device.alloc(18 * n * 4, DType.F32, [18, n])
            params = routemm.GgmlQuantizedMatmulIdParams(
                9, n, k, 2, 4, GgmlType(name), stack[0].nbytes, Layout.SHARED_PER_TOKEN, route
            )
            scratch = routemm.DenseMatmulIdScratch(device, 4, 9) if route.is_grouped else None
            encoder = device.command_encoder()
            routemm.quantized_matmul_id_ggml(
                encoder, registry, device.from_numpy(x), device.from_numpy(stack.reshape(-1)),
                device.from_numpy(ids), out, scratch, params,
            )
            encoder.commit_and_wait()
            outputs[f"{name}/{route.value}"] = out.numpy()
    np.savez(sys.argv[1], **outputs)
    print(json.dumps({"isa": device.properties["isa"]}))
    """
)


def _run_clone(isa: str, path, threads: int = 2) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ROUTEMM_BACKEND"}
    env["ROUTEMM_CPU_ISA"] = isa
    env["ROUTEMM_CPU_THREADS"] = str(threads)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["isa"]


@pytest.mark.skipif("cpu" not in routemm.available_backends(), reason="no cpu backend")
def test_cpu_isa_clones_are_bit_identical(tmp_path):
    ran = {}
    for isa in ("portable", "avx2", "avx512"):
        path = tmp_path / f"{isa}.npz"
        if _run_clone(isa, path) != isa:
            continue  # the CPU lacks this clone (its cap selected a lower one)
        with np.load(path) as data:
            ran[isa] = {name: data[name] for name in data.files}
    if len(ran) < 2:
        pytest.skip(f"this CPU runs only the {', '.join(ran)} clone")
    best = list(ran)[-1]
    _run_clone(best, tmp_path / "one_thread.npz", threads=1)
    with np.load(tmp_path / "one_thread.npz") as data:
        ran[f"{best} on one thread"] = {name: data[name] for name in data.files}
    base_isa, base = next(iter(ran.items()))
    assert len(base) == 5 * len(KERNEL_FORMATS)
    for isa, outputs in ran.items():
        assert outputs.keys() == base.keys()
        for name, value in outputs.items():
            assert np.all(np.isfinite(value)), name
            np.testing.assert_array_equal(
                value.view(np.uint32), base[name].view(np.uint32), err_msg=f"{isa} vs {base_isa}: {name}"
            )


# ---- The experts block, the torch ops and MoeLayer ---------------------------------------------

E, H, INTER, TOP_K = 4, 256, 256, 2


def assert_equals_float_block(device, got, want, what=""):
    """The block stacks' experts block against the F32 block on the exactly dequantised stacks:
    the same bits where every route follows the lane contract (LANE_ORDER_EVERYWHERE), else the two
    summation orders within F32 accumulation error of each other."""
    if device.backend in LANE_ORDER_EVERYWHERE:
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max(), err_msg=what)


def expert_stacks(rng, gate_type, up_type, down_type):
    """(gate, up, down) block stacks of the given types and their dequantised float32 stacks."""
    blocks, floats = [], []
    for t, shape in ((gate_type, (E, INTER, H)), (up_type, (E, INTER, H)), (down_type, (E, H, INTER))):
        b = random_blocks(rng, t, shape)
        blocks.append(b)
        floats.append(dequantized(b, t, shape[-1]))
    return blocks, floats


def routing(rng, m):
    ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(m)]).astype(np.int64)
    return rng.uniform(-1.0, 1.0, (m, H)).astype(np.float32), ids, rng.uniform(0.1, 1.0, (m, TOP_K)).astype(np.float32)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_moe_experts_block_stacks_equal_their_float_stacks(device, registry, rng, ggml_type):
    emu_subset(device, ggml_type, m=None)
    """The block path and the F32 path over the exactly dequantised stacks follow one lane
    contract: the same bits, on every route."""
    _, _, _, _, _, _, direct, grouped = KERNEL_FORMATS[ggml_type.value]
    needs(registry, direct, grouped)
    (gate, up, down), (fg, fu, fd) = expert_stacks(rng, ggml_type, ggml_type, ggml_type)
    x, ids, w = routing(rng, 9)
    for route in ("direct", "grouped_prefill")[: 1 if device.backend == "metal_emu" else 2]:  # emu: slow
        got = routemm.moe_experts(x, ids, w, (gate, up), down, ggml_type=ggml_type, route=route, device=device)
        want = routemm.moe_experts(x, ids, w, (fg, fu), fd, route=route, device=device)
        assert_equals_float_block(device, got, want, route)


def test_torch_ops_take_every_kernel_format(rng):
    torch = pytest.importorskip("torch")
    import routemm.torch  # noqa: F401  (registers the ops)

    cpu = routemm.Device("cpu")
    x, ids, w = routing(rng, 5)
    for ggml_type in TYPES:
        (gate, up, down), _ = expert_stacks(rng, ggml_type, ggml_type, ggml_type)
        gate_up = np.concatenate([gate, up], axis=1)
        want = routemm.moe_experts(x, ids, w, gate_up, down, ggml_type=ggml_type, route="direct", device=cpu)
        t = [torch.from_numpy(a) for a in (x, ids, w, gate_up, down)]
        got = torch.ops.routemm.moe_experts(*t, None, ggml_type.value, True).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=ggml_type.value)
        rows = torch.ops.routemm.quantized_matmul_id(t[4], torch.from_numpy(x[:, :INTER].copy()), t[1], ggml_type.value)
        want_rows = routemm.matmul_id(down, x[:, :INTER], ids, ggml_type=ggml_type, route="direct", device=cpu)
        np.testing.assert_array_equal(rows.numpy().view(np.uint32), np.asarray(want_rows).view(np.uint32))


@pytest.mark.parametrize("ggml_type", [GgmlType.Q5_0, GgmlType.Q4_K], ids=lambda t: t.value)
def test_moe_layer_runs_block_stacks_of_every_format(device, registry, rng, ggml_type):
    needs(registry, KERNEL_FORMATS[ggml_type.value][6])
    (gate, up, down), (fg, fu, fd) = expert_stacks(rng, ggml_type, ggml_type, ggml_type)
    router = device.from_numpy((rng.standard_normal((E, H)) / 16).astype(np.float32))
    layer = routemm.MoeLayer(
        router, *(device.from_numpy(b) for b in (gate, up, down)), top_k=TOP_K, renormalize=True, ggml_type=ggml_type
    )
    f = layer.float_weights()  # dequantised exactly
    for got, want in ((f["gate"], fg), (f["up"], fu), (f["down"], fd)):
        np.testing.assert_array_equal(got, want)
    hidden = rng.uniform(-1.0, 1.0, (6, H)).astype(np.float32)
    logits = routemm.matmul_id(f["router"][None], hidden, np.zeros((6, 1), np.int32), device=device)
    weights, ids = routemm.moe_gate(logits, TOP_K, renormalize=True, device=device)
    out = routemm.moe_experts(hidden, ids, weights, (f["gate"], f["up"]), f["down"], device=device)
    assert_equals_float_block(device, layer(hidden), out)


# ---- Mixed types: gate, up and down each of their own format -----------------------------------

MIXED = (GgmlType.Q4_K, GgmlType.Q5_0, GgmlType.Q6_K)  # gate, up, down


def test_moe_experts_mixed_types_equal_their_float_stacks(device, registry, rng):
    needs(registry, *(KERNEL_FORMATS[t.value][6] for t in MIXED), *(KERNEL_FORMATS[t.value][7] for t in MIXED))
    (gate, up, down), (fg, fu, fd) = expert_stacks(rng, *MIXED)
    x, ids, w = routing(rng, 9)
    for route in ("direct", "grouped_prefill")[: 1 if device.backend == "metal_emu" else 2]:  # emu: slow
        got = routemm.moe_experts(x, ids, w, (gate, up), down, ggml_type=MIXED, route=route, device=device)
        want = routemm.moe_experts(x, ids, w, (fg, fu), fd, route=route, device=device)
        assert_equals_float_block(device, got, want, route)
    # One gate_up stack has one type; the down stack may differ.
    (gate, up, down), (fg, fu, fd) = expert_stacks(rng, GgmlType.Q4_1, GgmlType.Q4_1, GgmlType.MXFP4)
    got = routemm.moe_experts(
        x, ids, w, np.concatenate([gate, up], axis=1), down, ggml_type=("q4_1", "q4_1", "mxfp4"), device=device
    )
    want = routemm.moe_experts(x, ids, w, np.concatenate([fg, fu], axis=1), fd, device=device)
    assert_equals_float_block(device, got, want)


def test_mixed_type_refusals_name_the_argument(device, rng):
    (gate, up, down), _ = expert_stacks(rng, *MIXED)
    x, ids, w = routing(rng, 3)
    call = routemm.moe_experts
    with pytest.raises(
        routemm.InvalidArgumentError, match="one gate_up stack has one block type, got gate q4_k and up q5_0"
    ):
        call(x, ids, w, np.concatenate([gate, gate], axis=1), down, ggml_type=MIXED, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match=r"ggml_type as a tuple must name \(gate, up, down\) types"):
        call(x, ids, w, (gate, up), down, ggml_type=("q4_k", "q6_k"), device=device)
    with pytest.raises(
        routemm.InvalidArgumentError, match=r"ggml_type must be None .* tuple of them, got \('q4_k', 'q3_k'"
    ):
        call(x, ids, w, (gate, up), down, ggml_type=("q4_k", "q3_k", "q6_k"), device=device)
    # Each stack is checked against its own type: the down stack is not Q4_K.
    with pytest.raises(
        routemm.InvalidArgumentError, match=r"moe_experts q4_k weights must be uint8 \[E, n, k / 256 \* 144\]"
    ):
        call(x, ids, w, (gate, up), down, ggml_type=("q4_k", "q5_0", "q4_k"), device=device)
    # The core op: the up and down stacks' own types need block stacks.
    with pytest.raises(routemm.InvalidArgumentError, match="up_ggml_type and down_ggml_type need block stacks"):
        _core._moe_experts_workspace_bytes(3, 2, E, H, INTER, True, DType.F32, None, "direct", down_ggml_type="q6_k")
    with pytest.raises(routemm.InvalidArgumentError, match="one gate_up stack has one block type: up_ggml_type q5_0"):
        _core._moe_experts_workspace_bytes(3, 2, E, H, INTER, False, DType.U8, "q4_k", "direct", up_ggml_type="q5_0")


def test_moe_layer_takes_mixed_types(device, registry, rng):
    needs(registry, *(KERNEL_FORMATS[t.value][6] for t in MIXED))
    (gate, up, down), (fg, fu, fd) = expert_stacks(rng, *MIXED)
    router = device.from_numpy((rng.standard_normal((E, H)) / 16).astype(np.float32))
    layer = routemm.MoeLayer(
        router, *(device.from_numpy(b) for b in (gate, up, down)), top_k=TOP_K, renormalize=True, ggml_type=MIXED
    )
    assert layer.ggml_type == MIXED
    f = layer.float_weights()
    for got, want in ((f["gate"], fg), (f["up"], fu), (f["down"], fd)):
        np.testing.assert_array_equal(got, want)
    hidden = rng.uniform(-1.0, 1.0, (6, H)).astype(np.float32)
    logits = routemm.matmul_id(f["router"][None], hidden, np.zeros((6, 1), np.int32), device=device)
    weights, ids = routemm.moe_gate(logits, TOP_K, renormalize=True, device=device)
    out = routemm.moe_experts(hidden, ids, weights, (f["gate"], f["up"]), f["down"], device=device)
    assert_equals_float_block(device, layer(hidden), out)
    with pytest.raises(routemm.InvalidArgumentError, match=r"down experts must be \[4, 256, 256\]"):
        routemm.MoeLayer(
            router, *(device.from_numpy(b) for b in (gate, up, down)), top_k=TOP_K, renormalize=True,
            ggml_type=(GgmlType.Q4_K, GgmlType.Q5_0, GgmlType.Q4_K),
        )  # fmt: skip
