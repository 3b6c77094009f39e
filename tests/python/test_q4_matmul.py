"""quantized_matmul_ggml and encode_q4_route: every route against a float64 reference over the
dequantised weights (tails in M, N and K), V2 == 64x32 bit identity, mat-vec at m = 1..8, routing
under each policy (explicit and from the environment), receipts, geometry and JSON."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import routemm
from routemm import DenseQ4DecisionSource as Decision
from routemm import DenseQ4Route as Route
from routemm import GgmlRoutingPolicy as Policy
from routemm import GgmlTensorMmPreference as Pref
from routemm import q4_0
from support import PAD_BYTE, POISON_U32, Q4_BASE_PIPELINES, guarded, guarded_output, validate
from tolerances import Q4_CUDA_BF16_FROBENIUS, Q4_CUDA_NUMERICS, accumulation_bound, q4_gpu_bound, q4_tolerance

# Backends without the Q4_0 pipelines skip.
pytestmark = pytest.mark.needs_kernels(*Q4_BASE_PIPELINES)

LABEL_SUFFIX = "|700:i1|701:i1|702:i1"
ROUTES = list(Route)
DEFAULT = Policy()


class Q4Case:
    """Guarded Q4_0 weight, input and output buffers for one (m, n, k), with the reference."""

    def __init__(self, device, rng, m: int, n: int, k: int, x: np.ndarray | None = None):
        self.device, self.m, self.n, self.k = device, m, n, k
        w = rng.uniform(-1.0, 1.0, (n, k)).astype(np.float32)
        self.blocks = q4_0.quantize(w)
        self.w = q4_0.dequantize(self.blocks)  # the exact weights the kernels multiply with
        self.x = rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32) if x is None else x
        self.weight = guarded(device, self.blocks, routemm.DType.U8, self.blocks.shape)
        self.input = guarded(device, self.x, routemm.DType.F32, self.x.shape)
        self.output = guarded_output(device, m, n)
        x64, w64 = self.x.astype(np.float64), self.w.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs give non-finite refs
            self.ref, self.magnitude = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T

    def params(self) -> routemm.GgmlQuantizedMatmulParams:
        return routemm.GgmlQuantizedMatmulParams(self.m, self.n, self.k)

    def run(self, registry, route: Route | None = None, routing: Policy | None = DEFAULT):
        """Runs the op (forced `route`, else the policy); checks receipt, dispatch and buffers."""
        self.output.parent.copy_from_numpy(self.output.initial)
        encoder = self.device.command_encoder()
        encoder.start_encoded_dispatch_receipt(1)
        before = routemm.dispatch_count()
        if route is None:
            receipt = routemm.quantized_matmul_ggml(
                encoder, registry, self.input.view, self.weight.view, self.output.view, self.params(), routing
            )
        else:
            receipt = routemm.encode_q4_route(
                encoder, registry, self.input.view, self.weight.view, self.output.view, self.params(), route
            )
        assert routemm.dispatch_count() - before == 1 == receipt.dispatch_count
        assert encoder.take_encoded_dispatch_receipt() == [receipt.dispatch]
        encoder.commit_and_wait()
        validate(receipt)
        assert receipt.pipeline_label == receipt.dispatch.pipeline_label
        self.weight.assert_unchanged("weight")
        self.input.assert_unchanged("input")
        self.output.assert_guards_intact("output")
        words = self.output.view_bytes().view(np.uint32)
        assert not np.any(words == POISON_U32), "output element(s) never written"
        return words.view(np.float32).reshape(self.m, self.n).copy(), receipt

    def check(self, out: np.ndarray, route_name: str, table: bool = True) -> None:
        """The route's rigorous bound; on the CPU also the tolerance table, which states (abs, rel)
        for data of magnitude ~1 (`table=False` for data far from it, where cancellation makes a
        relative tolerance meaningless)."""
        got = out.astype(np.float64)
        err = np.abs(got - self.ref)
        if self.device.backend == "cuda":  # tensor-core numerics: the route's own bound
            bound = q4_gpu_bound(route_name, self.k, self.magnitude)
            assert np.all(err <= bound), f"{route_name}: worst excess {np.max(err - bound):.3e}"
            if Q4_CUDA_NUMERICS[route_name] == "bf16":
                frob = np.linalg.norm(got - self.ref) / max(np.linalg.norm(self.ref), 1e-300)
                assert frob <= Q4_CUDA_BF16_FROBENIUS, f"{route_name}: relative Frobenius error {frob:.3e}"
            return
        bound = accumulation_bound(self.k, self.magnitude)
        assert np.all(err <= bound), f"{route_name}: worst excess {np.max(err - bound):.3e}"
        if not table:
            return
        atol, rtol = q4_tolerance(route_name, self.k)
        np.testing.assert_allclose(got, self.ref, atol=atol, rtol=rtol, err_msg=route_name)


# ---- numerics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", range(1, 9))
# K = 2048 and up: long enough that backends splitting K (CUDA clusters) do so. On CUDA (sm_90):
# (70, 2048) is one row tile with a tail, 2 stages per split; (200, 4352) an 8-way split whose last
# two splits are empty; (130, 14336) 7 stages per split, so every warp's ring wraps around.
@pytest.mark.parametrize("n,k", [(1, 32), (13, 64), (67, 800), (70, 2048), (200, 4352), (130, 14336)])
def test_mat_vec_against_reference(device, registry, rng, m, n, k):
    case = Q4Case(device, rng, m, n, k)
    out, receipt = case.run(registry)
    assert receipt.route == "mat_vec" and receipt.dense_route is None
    assert receipt.decision is Decision.MAT_VEC_THRESHOLD
    assert receipt.pipeline_label == "kernel_mul_mv_q4_0_f32" + LABEL_SUFFIX
    case.check(out, "mat_vec")


def _wide_range_activations(rng, m: int, k: int) -> np.ndarray:
    """Activations whose 32-value blocks span many binades: each value scaled by 2^[-40, 40], one
    block per token all zero, one of subnormals, one with a single outlier among tiny values."""
    x = rng.uniform(-1.0, 1.0, (m, k)) * np.exp2(rng.integers(-40, 41, (m, k)))
    blocks = x.reshape(m, k // 32, 32)
    blocks[:, 0] = 0.0
    blocks[:, 1] = rng.integers(-(2**20), 2**20, (m, 32)) * 2.0**-149
    blocks[:, 2] = rng.uniform(-1.0, 1.0, (m, 32)) * 2.0**-30
    blocks[:, 2, 5] = 3.0e4
    return x.astype(np.float32)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(13, 128), (70, 2048)])
def test_mat_vec_wide_range_activations(device, registry, rng, m, n, k):
    """Per-block dynamic range, zeros, subnormals and outliers: every backend's mat-vec stays within
    its stated bound (on CUDA the split numerics hold each value to 2^-16 of itself)."""
    case = Q4Case(device, rng, m, n, k, x=_wide_range_activations(rng, m, k))
    out, receipt = case.run(registry)
    assert receipt.route == "mat_vec"
    case.check(out, "mat_vec", table=False)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mat_vec_non_finite_activation_poisons_its_outputs(device, registry, rng, bad):
    """A NaN or infinity in a token's activations makes that token's outputs non-finite (NaN on
    CUDA, whose split of an infinity is inf + NaN; the IEEE result on the CPU) and leaves the other
    tokens' outputs exact within the route's bound."""
    m, n, k = 3, 20, 256
    x = rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32)
    x[1, 77] = bad
    with np.errstate(invalid="ignore"):  # the float64 reference of token 1 is non-finite too
        case = Q4Case(device, rng, m, n, k, x=x)
    out, _ = case.run(registry)
    assert not np.any(np.isfinite(out[1]))
    finite = Q4Case.__new__(Q4Case)
    finite.__dict__.update(case.__dict__)
    keep = [0, 2]
    finite.m, finite.x = 2, x[keep]
    finite.ref, finite.magnitude = (
        case.ref[keep],
        case.magnitude[keep],
    )
    finite.check(out[keep], "mat_vec")


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(4500, 256), (33, 14336), (17, 512)])
def test_few_token_mat_vec_row_groups_and_slabs(device, registry, rng, m, n, k):
    """One to four tokens with K % 256 == 0 (one and two: the Hopper bulk-copy mat-vec on CUDA;
    three and four: the cp.async mat-vec's hi / lo columns): more 16-row groups than the grid
    holds (4500 rows: CTAs loop over groups), one row past a group (33, 17), seven full 64-block
    slabs (14336) and a slab shorter than the consumer warps' share (512: 16 blocks). Every output
    written (poisoned before) and within the mat-vec's bound; a second run repeats the bits."""
    case = Q4Case(device, rng, m, n, k)
    out, receipt = case.run(registry)
    assert receipt.route == "mat_vec"
    case.check(out, "mat_vec", table=False)
    again, _ = case.run(registry)
    assert np.array_equal(out.view(np.uint32), again.view(np.uint32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_one_token_non_finite_activation_poisons_every_output(device, registry, rng, bad):
    """One token with a NaN or infinity at K % 256 == 0: every output is non-finite."""
    x = rng.uniform(-1.0, 1.0, (1, 512)).astype(np.float32)
    x[0, 300] = bad
    with np.errstate(invalid="ignore"):
        case = Q4Case(device, rng, 1, 40, 512, x=x)
    out, _ = case.run(registry)
    assert not np.any(np.isfinite(out))


# K % 256 == 0 with a 16-byte aligned weight view (2560, 512, 4352, 256) is where CUDA's bf16 routes
# take the Hopper kernel (H100/H200): (150, 136, 512) has token and row tails on both tiles and no K
# split; (20, 40, 4352) splits K 8 ways with the last two splits empty; (9, 1, 256) is one weight
# row and one stage, the tiles mostly past the tensors' ends.
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.value)
@pytest.mark.parametrize(
    "m,n,k",
    [
        (9, 1, 32),
        (33, 65, 64),
        (129, 77, 800),
        (40, 130, 96),
        (33, 77, 2560),
        (150, 136, 512),
        (20, 40, 4352),
        (9, 1, 256),
    ],
)
def test_every_route_against_reference(device, registry, rng, route, m, n, k):
    case = Q4Case(device, rng, m, n, k)
    out, receipt = case.run(registry, route)
    assert receipt.dense_route is route and receipt.decision is Decision.FORCED_TEST
    assert receipt.dispatch == routemm.q4_expected_dispatch(route, m, n, registry=registry, k=k)
    case.check(out, route.value)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.value)
def test_every_route_with_unaligned_weight_view(device, registry, rng, route):
    """A weight view 2 bytes off 16-byte alignment (K % 256 == 0): the kernels that need aligned
    views (TMA, 16-byte copies) are not taken; the result keeps the route's numerics."""
    case = Q4Case(device, rng, 40, 70, 512)
    case.weight = guarded(
        device, case.blocks, routemm.DType.U8, case.blocks.shape, guard=np.full(18, PAD_BYTE, np.uint8)
    )
    out, _ = case.run(registry, route)
    case.check(out, route.value)


@pytest.mark.parametrize("which", ["weight", "weight4", "weight_odd", "input"])
@pytest.mark.parametrize("m", [1, 3, 5, 8])
def test_mat_vec_with_unaligned_views(device, registry, rng, which, m):
    """A weight view 2, 4 or 1 bytes or an input view 4 bytes off 16-byte alignment (K % 256 == 0):
    CUDA's mat-vec takes its narrower copy paths instead of 16-byte or bulk copies; same tile,
    splits and per-block order (for one token on Hopper: the same fixed order of the bulk-copy
    kernel), so the same bits as with aligned views."""
    case = Q4Case(device, rng, m, 150, 4608)
    aligned, _ = case.run(registry)
    if which.startswith("weight"):
        guard = np.full({"weight": 18, "weight4": 20, "weight_odd": 17}[which], PAD_BYTE, np.uint8)
        case.weight = guarded(device, case.blocks, routemm.DType.U8, case.blocks.shape, guard=guard)
    else:
        guard = np.full(20, PAD_BYTE, np.uint8)
        case.input = guarded(device, case.x, routemm.DType.F32, case.x.shape, guard=guard)
    out, receipt = case.run(registry)
    assert receipt.route == "mat_vec"
    case.check(out, "mat_vec", table=False)
    assert np.array_equal(out.view(np.uint32), aligned.view(np.uint32))


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
@pytest.mark.parametrize(
    "m,n,k", [(9, 64, 32), (33, 70, 800), (200, 129, 64), (9, 70, 2048), (40, 136, 2560), (150, 136, 512)]
)
def test_v2_and_64x32_bit_identical(device, registry, rng, m, n, k):
    case = Q4Case(device, rng, m, n, k)
    v2, _ = case.run(registry, Route.COMPATIBILITY_V2)
    candidate, _ = case.run(registry, Route.TENSOR_64X32)
    assert np.array_equal(v2.view(np.uint32), candidate.view(np.uint32))


def test_cpu_routes_share_one_order(rng):
    """CPU contract: the mat-vec and all four matrix routes are bit-identical (one FMA-lane order)."""
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    case = Q4Case(device, rng, 9, 37, 288)
    outs = [case.run(registry, route)[0] for route in ROUTES]
    # The first 8 rows through the mat-vec pipeline.
    sub = Q4Case.__new__(Q4Case)
    sub.__dict__.update(case.__dict__)
    sub.m = 8
    sub.input = guarded(device, case.x[:8], routemm.DType.F32, (8, case.k))
    sub.output = guarded_output(device, 8, case.n)
    mv, _ = sub.run(registry)
    for out in outs:
        assert np.array_equal(out.view(np.uint32), outs[0].view(np.uint32))
    assert np.array_equal(mv.view(np.uint32), outs[0][:8].view(np.uint32))


def test_repeatable_bits(device, registry, rng):
    case = Q4Case(device, rng, 65, 100, 256)
    first, _ = case.run(registry)
    second, _ = case.run(registry)
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


# ---- routing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,route,decision",
    [
        (Policy(), Route.COMPATIBILITY_V2, Decision.NO_PLAN_COMPATIBILITY_FALLBACK),
        (Policy(Pref.FORCE_SIMD), Route.COMPATIBILITY_SIMDGROUP, Decision.INELIGIBLE_COMPATIBILITY_FALLBACK),
        (Policy(Pref.FORCE_SIMD, False), Route.COMPATIBILITY_SIMDGROUP, Decision.INELIGIBLE_COMPATIBILITY_FALLBACK),
        (
            Policy(allow_dense_large_tile_mm=False),
            Route.COMPATIBILITY_TENSOR_V1,
            Decision.INELIGIBLE_COMPATIBILITY_FALLBACK,
        ),
    ],
)
def test_routing_policy(device, registry, rng, policy, route, decision):
    case = Q4Case(device, rng, 9, 20, 64)
    out, receipt = case.run(registry, routing=policy)
    assert (receipt.dense_route, receipt.decision, receipt.policy) == (route, decision, policy)
    assert receipt.pipeline_label == route.pipeline_name + LABEL_SUFFIX == route.pipeline_label
    assert receipt.dispatch == routemm.q4_expected_dispatch(route, 9, 20, registry=registry, k=64)
    assert routemm.select_dense_q4_route(case.params(), policy) == (route, decision)
    case.check(out, route.value)


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
def test_threshold_is_eight(device, registry, rng):
    for m, route in ((8, "mat_vec"), (9, "compatibility_v2")):
        _, receipt = Q4Case(device, rng, m, 8, 32).run(registry)
        assert receipt.route == route


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, Policy()),
        ({"ROUTEMM_DISABLE_TENSOR_MM": "1"}, Policy(Pref.FORCE_SIMD, True)),
        ({"ROUTEMM_DISABLE_TENSOR_MM": "0"}, Policy()),
        ({"ROUTEMM_LARGE_TILE_MM": "0"}, Policy(Pref.AUTO_PROBE, False)),
        ({"ROUTEMM_LARGE_TILE_MM": "false"}, Policy(Pref.AUTO_PROBE, False)),
        ({"ROUTEMM_LARGE_TILE_MM": "OFF"}, Policy(Pref.AUTO_PROBE, False)),
        ({"ROUTEMM_LARGE_TILE_MM": "1"}, Policy()),
        ({"ROUTEMM_DISABLE_TENSOR_MM": "1", "ROUTEMM_LARGE_TILE_MM": "off"}, Policy(Pref.FORCE_SIMD, False)),
    ],
)
def test_policy_from_environment(monkeypatch, device, registry, rng, env, expected):
    monkeypatch.delenv("ROUTEMM_DISABLE_TENSOR_MM", raising=False)
    monkeypatch.delenv("ROUTEMM_LARGE_TILE_MM", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert Policy.from_environment() == expected
    case = Q4Case(device, rng, 12, 16, 32)
    _, receipt = case.run(registry, routing=None)  # routing=None reads the environment now
    assert receipt.policy == expected
    assert receipt.dense_route == routemm.select_dense_q4_route(case.params(), expected)[0]
    # An explicit policy never reads the environment.
    _, explicit = case.run(registry, routing=Policy())
    assert explicit.dense_route is Route.COMPATIBILITY_V2 and explicit.policy == Policy()


# ---- receipts, geometry, JSON ----------------------------------------------------------------------


def test_expected_dispatch_spec_example():
    grids = {route: routemm.q4_expected_dispatch(route, 129, 769).grid for route in ROUTES}
    assert grids == {
        Route.COMPATIBILITY_SIMDGROUP: (5, 13, 1),
        Route.COMPATIBILITY_TENSOR_V1: (5, 13, 1),
        Route.COMPATIBILITY_V2: (2, 13, 1),
        Route.TENSOR_64X32: (5, 13, 1),
    }
    shmem = {route: routemm.q4_expected_dispatch(route, 129, 769).threadgroup_memory for route in ROUTES}
    assert shmem == {
        Route.COMPATIBILITY_SIMDGROUP: ((0, 8192),),
        Route.COMPATIBILITY_TENSOR_V1: ((0, 8192),),
        Route.COMPATIBILITY_V2: ((0, 4096),),
        Route.TENSOR_64X32: ((0, 4096),),
    }
    for route in ROUTES:
        d = routemm.q4_expected_dispatch(route, 129, 769)
        assert d.threads_per_threadgroup == (128, 1, 1)
        assert d.dispatch_kind is routemm.DispatchKind.THREAD_GROUPS
        assert d.pipeline_label == route.pipeline_label
        validate(d)


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
def test_encoded_geometry_spec_example(device, registry, rng):
    case = Q4Case(device, rng, 129, 769, 32)
    for route in ROUTES:
        _, receipt = case.run(registry, route)
        assert receipt.dispatch == routemm.q4_expected_dispatch(route, 129, 769, registry=registry, k=32)
        if device.backend == "cpu":  # the CPU backend encodes the reference geometry itself
            assert receipt.dispatch == routemm.q4_expected_dispatch(route, 129, 769)


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
@pytest.mark.parametrize("m,n,k", [(9, 4096, 14336), (512, 4096, 14336), (4096, 512, 2048), (33, 70, 800)])
def test_registry_geometry_is_shape_derived(registry, m, n, k):
    """Every matrix route of one shape gets the same K split (grid.z), so V2 and 64x32 can agree."""
    dispatches = {route: routemm.q4_expected_dispatch(route, m, n, registry=registry, k=k) for route in ROUTES}
    assert len({d.grid[2] for d in dispatches.values()}) == 1
    for route, d in dispatches.items():
        assert d.pipeline_label == route.pipeline_label and d.grid[0] >= 1 and d.grid[1] >= 1
        validate(d)


def test_expected_dispatch_with_registry_needs_k(registry):
    with pytest.raises(routemm.InvalidArgumentError, match="needs k"):
        routemm.q4_expected_dispatch(Route.COMPATIBILITY_V2, 9, 64, registry=registry)


def test_mat_vec_geometry(device, registry, rng):
    _, receipt = Q4Case(device, rng, 3, 17, 64).run(registry)
    d = receipt.dispatch
    assert d.dispatch_kind is routemm.DispatchKind.THREAD_GROUPS
    if device.backend in ("cpu", "metal", "metal_emu"):  # spec §5.5: [ceil(N/8), M, 1], [8, 8, 1]
        assert (d.grid, d.threads_per_threadgroup, d.threadgroup_memory) == ((3, 3, 1), (8, 8, 1), ())
    else:  # CUDA: 8 x (threads / 8) threads; x walks output rows, y tokens, z the K split
        assert d.threads_per_threadgroup[0] == 8 and d.grid[1] == 1 and d.grid[2] >= 1


def test_pipeline_names():
    assert routemm.Q4_MATMUL_PIPELINE_NAMES == (
        "kernel_mul_mv_q4_0_f32",
        "kernel_mul_mm_q4_0_f32",
        "kernel_mul_mm_q4_0_tensor_f32",
        "kernel_mul_mm_q4_0_tensor_v2_f32",
        "kernel_mul_mm_q4_0_tensor_64x32_f32",
    )
    assert [r.pipeline_name for r in ROUTES] == list(routemm.Q4_MATMUL_PIPELINE_NAMES[1:])
    assert [r.value for r in ROUTES] == [
        "compatibility_simdgroup",
        "compatibility_tensor_v1",
        "compatibility_v2",
        "tensor_64x32",
    ]
    assert routemm.GgmlType.Q4_0.value == "q4_0" and routemm.GgmlType.Q4_0.block_layout == (32, 18)


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
def test_registry_has_every_pipeline(registry):
    for name in routemm.Q4_MATMUL_PIPELINE_NAMES:
        assert registry.has_kernel(name)


def test_json_round_trips(device, registry, rng):
    _, receipt = Q4Case(device, rng, 10, 9, 64).run(registry)
    records = [receipt, Policy(), Policy(Pref.FORCE_SIMD, False), routemm.GgmlQuantizedMatmulParams(3, 4, 64)]
    for record in records:
        validate(record)
        again = type(record).from_json(record.to_json())
        assert again == record
    text = receipt.to_dict()
    with pytest.raises(routemm.InvalidArgumentError, match="unknown field"):
        routemm.GgmlQuantizedMatmulReceipt.from_dict({**text, "extra": 1})
    with pytest.raises(routemm.InvalidArgumentError, match="schema_version"):
        routemm.GgmlQuantizedMatmulReceipt.from_dict({**text, "schema_version": 99})
    with pytest.raises(routemm.InvalidArgumentError, match="unknown field"):
        Policy.from_dict({**Policy().to_dict(), "x": 0})
    # Every field of spec §4.1, with its default.
    assert Policy().to_dict() == {
        "dense_tensor_mm": "auto_probe",
        "allow_dense_large_tile_mm": True,
        "dense_decode_mvn": True,
        "dense_decode_mv_ext": False,
        "dense_q6k_mv_nr2": True,
        "dense_q8_0_mv_nr2": True,
        "dense_int8_dot": False,
        "expert_mm_threshold": 8,
        "expert_q6k_mv_nr2": True,
        "expert_q8_0_mv_nr2": False,
        "expert_tensor_mm": "auto_probe",
    }


def test_schema_rejects_inconsistent_receipt(device, registry, rng):
    jsonschema = pytest.importorskip("jsonschema")
    _, receipt = Q4Case(device, rng, 10, 9, 64).run(registry)
    broken = dataclasses.replace(receipt, route="mat_vec")  # label says V2
    with pytest.raises(jsonschema.ValidationError):
        routemm.core._schemas.validate(broken)


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Policy().allow_dense_large_tile_mm = False  # type: ignore[misc]


@pytest.mark.needs_kernels(Route.TENSOR_64X32.pipeline_name)
def test_rejected_launch_names_its_pipeline(device, registry, rng):
    """A kernel that rejects its launch (here: a raw dispatch of the 64x32 route whose arguments
    satisfy the argument contract but whose grid is not the route's tiles) fails the submission
    with a CommandBufferError naming that pipeline, whether the backend launches at encode (CUDA)
    or at commit (CPU). Metal kernels have no error channel: there a tile past M writes nothing."""
    if device.backend in ("metal", "metal_emu"):
        pytest.skip("Metal kernels cannot reject a launch (a tile past M writes nothing)")
    case = Q4Case(device, rng, 9, 16, 64)
    encoder = device.command_encoder()
    encoder.start_capture()
    routemm.encode_q4_route(
        encoder, registry, case.input.view, case.weight.view, case.output.view, case.params(), Route.TENSOR_64X32
    )
    (node,) = encoder.take_capture()
    params = next(b["bytes"] for b in node.bindings if b["slot"] == 0)
    pipeline = registry.get_pipeline(Route.TENSOR_64X32.pipeline_name, [(700, 1), (701, 1), (702, 1)])
    grid = (node.dispatch.grid[0] + 1, *node.dispatch.grid[1:])
    args = [(0, params), (1, case.weight.view), (2, case.input.view), (3, case.output.view)]
    with pytest.raises(routemm.CommandBufferError) as info:
        encoder.dispatch(
            pipeline,
            args,
            grid,
            node.dispatch.threads_per_threadgroup,
            threadgroup_memory=node.dispatch.threadgroup_memory,
        )
        encoder.commit_and_wait()
    assert info.value.pipeline_label == Route.TENSOR_64X32.pipeline_label


def test_argument_contract_travels_with_the_code(device, registry, rng):
    """The mat-vec's code under the 64x32 name keeps the mat-vec's argument contract: given the
    matrix routes' arguments, the dispatch is refused before anything is encoded, naming the
    pipeline."""
    registry.register_kernel_from(Route.TENSOR_64X32.pipeline_name, "kernel_mul_mv_q4_0_f32")
    case = Q4Case(device, rng, 9, 16, 64)
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match=re.escape(Route.TENSOR_64X32.pipeline_label)):
        routemm.encode_q4_route(
            encoder, registry, case.input.view, case.weight.view, case.output.view, case.params(), Route.TENSOR_64X32
        )
    assert encoder.pending_dispatches == 0
