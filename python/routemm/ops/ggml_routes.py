"""Pure structural routing decisions for GGML-format products (spec §4.2).

`plan_dense_auto_route` is the dense planner: which kernel route a dense call of a GGML type takes
at M rows and width K under a routing policy. `ggml_capability` answers a whole request -- the
route, whether routemm can execute it, block layout, minimum weight bytes, scratch and internal
dispatch counts, or a rejection code with a diagnostic. Both are pure: no device, no environment.

routemm executes the dense Q4_0 routes (mat-vec for M <= 8, matrix for M > 8) through
quantized_matmul_ggml, which takes its mat-vec/matrix split from plan_dense_auto_route. Every other
route is decided structurally, exactly as the policy asks, and reported with executable=False and
a diagnostic saying routemm has no kernel for it yet.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

from ..core._core_api import DType
from ..core._errors import InvalidArgumentError
from .quantized_matmul import MM_ROUTING_THRESHOLD, GgmlRoutingPolicy, GgmlTensorMmPreference, GgmlType

GGML_CAPABILITY_SCHEMA_VERSION = 1
U64_MAX = 2**64 - 1
# The GGML types with a width-mN multi-column mat-vec (bit-identical to the mat-vec).
_MVN_TYPES = frozenset({GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K})
_K_QUANTS = frozenset({GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K, GgmlType.IQ4_XS})
_NATIVE_SCALAR = frozenset({DType.F32, DType.F16, DType.BF16})


class GgmlKernelRoute(enum.Enum):
    DENSE_MV = "dense_mv"
    DENSE_MVN = "dense_mvn"  # K-quants, M in [2, 8]: multi-column tiles
    DENSE_MV_EXT = "dense_mv_ext"  # opt-in mul_mv_ext, M in [2, 8]
    DENSE_MM = "dense_mm"
    NATIVE_SCALAR_MV = "native_scalar_mv"
    NATIVE_SCALAR_MM = "native_scalar_mm"
    EXPERT_MV_ID = "expert_mv_id"
    EXPERT_MM_ID = "expert_mm_id"
    EMBEDDING_GATHER = "embedding_gather"


class GgmlWorkload(enum.Enum):
    DECODE_SINGLE = "decode_single"  # M == 1
    CONTINUOUS_WIDTH = "continuous_width"  # M in [2, 8]
    PROMPT = "prompt"
    EMBEDDING = "embedding"


class GgmlInvocationKind(enum.Enum):
    DENSE_AUTO = "dense_auto"
    DENSE_BATCHED_MV = "dense_batched_mv"
    DENSE_BATCHED_MM = "dense_batched_mm"
    DENSE_PERM021_BF16 = "dense_perm021_bf16"
    DENSE_GATE_UP_SILU_PAIR = "dense_gate_up_silu_pair"
    EXPERT_AUTO_ALLOCATED = "expert_auto_allocated"
    EXPERT_FORCE_MV = "expert_force_mv"
    EXPERT_POOLED = "expert_pooled"
    EXPERT_POOLED_PAIR = "expert_pooled_pair"
    EXPERT_SWIGLU_DOWN_Q4 = "expert_swiglu_down_q4"
    EMBEDDING_GATHER = "embedding_gather"


class GgmlRejectionCode(enum.Enum):
    INVALID_DIMENSIONS = "invalid_dimensions"
    INVALID_OPERATION_CONTRACT = "invalid_operation_contract"
    UNSUPPORTED_TYPE = "unsupported_type"
    UNSUPPORTED_LAYOUT = "unsupported_layout"
    UNSUPPORTED_REGIME = "unsupported_regime"
    ARITHMETIC_OVERFLOW = "arithmetic_overflow"


@dataclasses.dataclass(frozen=True)
class GgmlExpertShape:
    n_tokens: int
    n: int
    k: int
    top_k: int
    n_experts: int
    expert_stride_bytes: int
    ids_are_distinct_per_token: bool = True
    ids_within_expert_range: bool = True


@dataclasses.dataclass(frozen=True)
class GgmlInvocation:
    """What is asked: a dense call (m rows, n outputs, k inputs) or an expert call (`expert`)."""

    kind: GgmlInvocationKind
    m: int = 0
    n: int = 0
    k: int = 0
    expert: Optional[GgmlExpertShape] = None


@dataclasses.dataclass(frozen=True)
class GgmlCapabilityRequest:
    invocation: GgmlInvocation
    ggml_type: Union[GgmlType, DType]
    workload: GgmlWorkload
    routing: GgmlRoutingPolicy = GgmlRoutingPolicy()
    schema_version: int = GGML_CAPABILITY_SCHEMA_VERSION


@dataclasses.dataclass(frozen=True)
class GgmlExpertMmScratch:
    htpe_bytes: int  # 4 * n_experts
    hids_bytes: int  # 4 * n_experts * n_tokens
    caller_owned: bool
    schedule_reused: bool


@dataclasses.dataclass(frozen=True)
class GgmlCapability:
    executable: bool
    route: Optional[GgmlKernelRoute]
    specialized_for_workload: bool
    correctness_fallback: bool
    requires_device_probe: bool
    block_values: int
    block_bytes: int
    weight_buffer_count: int
    minimum_weight_bytes: int
    scratch: Optional[GgmlExpertMmScratch]
    dispatches: int
    barriers: int
    rejection_code: Optional[GgmlRejectionCode]
    diagnostic: Optional[str]
    schema_version: int = GGML_CAPABILITY_SCHEMA_VERSION


def _layout(ggml_type) -> tuple[int, int]:
    if isinstance(ggml_type, DType):
        return 1, ggml_type.size
    return GgmlType(ggml_type).block_layout


def plan_dense_auto_route(
    ggml_type: Union[GgmlType, DType], m: int, k: int, policy: GgmlRoutingPolicy
) -> GgmlKernelRoute:
    """The dense auto planner (spec §4.2): F32/F16/BF16 are native scalar routes (mat-vec at M == 1,
    else matrix); K-quants take the width-mN tiles at M in [2, 8] when dense_decode_mvn; mul_mv_ext
    when opted in (Q4_0/Q8_0 from M >= 2, K-quants from M >= 4, K >= 32); the matrix route when
    M > 8 and K >= 32; otherwise the mat-vec."""
    if isinstance(ggml_type, DType):
        if ggml_type not in _NATIVE_SCALAR:
            raise InvalidArgumentError(f"plan_dense_auto_route: {ggml_type.type_name} is not a GGML weight type")
        return GgmlKernelRoute.NATIVE_SCALAR_MV if m == 1 else GgmlKernelRoute.NATIVE_SCALAR_MM
    t = GgmlType(ggml_type)
    width = 2 <= m <= 8
    if width and policy.dense_decode_mvn and t in _MVN_TYPES:
        return GgmlKernelRoute.DENSE_MVN
    if width and policy.dense_decode_mv_ext and k >= 32 and m >= (4 if t in _K_QUANTS else 2):
        return GgmlKernelRoute.DENSE_MV_EXT
    if m > MM_ROUTING_THRESHOLD and k >= 32:
        return GgmlKernelRoute.DENSE_MM
    return GgmlKernelRoute.DENSE_MV


def _workload_fits(workload: GgmlWorkload, m: int) -> bool:
    return {
        GgmlWorkload.DECODE_SINGLE: m == 1,
        GgmlWorkload.CONTINUOUS_WIDTH: 2 <= m <= 8,
        GgmlWorkload.PROMPT: m >= 1,
        GgmlWorkload.EMBEDDING: False,
    }[workload]


def ggml_capability(request: GgmlCapabilityRequest) -> GgmlCapability:
    """The structural answer to `request` (pure; spec §4.2). Never raises for a well-typed request:
    what cannot run is a rejection code with a diagnostic."""
    if request.schema_version != GGML_CAPABILITY_SCHEMA_VERSION:
        raise InvalidArgumentError(
            f"ggml_capability: request schema_version {request.schema_version!r} is not {GGML_CAPABILITY_SCHEMA_VERSION}"
        )
    inv, policy = request.invocation, request.routing
    values, block = _layout(request.ggml_type)
    type_name = (
        request.ggml_type.type_name if isinstance(request.ggml_type, DType) else GgmlType(request.ggml_type).value
    )

    def result(route=None, code=None, diagnostic=None, *, executable=False, weight_bytes=0, scratch=None, d=0, b=0):
        return GgmlCapability(
            executable=executable and code is None,
            route=route,
            specialized_for_workload=route in (GgmlKernelRoute.DENSE_MVN, GgmlKernelRoute.DENSE_MV_EXT),
            correctness_fallback=False,
            requires_device_probe=route is GgmlKernelRoute.DENSE_MM
            and GgmlTensorMmPreference(policy.dense_tensor_mm) is GgmlTensorMmPreference.AUTO_PROBE,
            block_values=values,
            block_bytes=block,
            weight_buffer_count=1,
            minimum_weight_bytes=weight_bytes,
            scratch=scratch,
            dispatches=d,
            barriers=b,
            rejection_code=code,
            diagnostic=diagnostic,
        )

    R = GgmlRejectionCode
    if inv.kind is GgmlInvocationKind.DENSE_AUTO:
        m, n, k = inv.m, inv.n, inv.k
        if m <= 0 or n <= 0 or k <= 0 or k % values:
            return result(code=R.INVALID_DIMENSIONS, diagnostic=f"M, N, K must be > 0 and K a multiple of {values}")
        if not _workload_fits(request.workload, m):
            return result(
                code=R.INVALID_OPERATION_CONTRACT,
                diagnostic=f"workload {request.workload.value} does not admit M={m}",
            )
        weight_bytes = n * (k // values) * block
        if weight_bytes > U64_MAX:
            return result(code=R.ARITHMETIC_OVERFLOW, diagnostic="weight bytes overflow u64")
        route = plan_dense_auto_route(request.ggml_type, m, k, policy)
        runs = request.ggml_type is GgmlType.Q4_0 and route in (GgmlKernelRoute.DENSE_MV, GgmlKernelRoute.DENSE_MM)
        diagnostic = None if runs else f"routemm has no {route.value} kernel for {type_name} yet"
        if request.ggml_type is GgmlType.Q4_0 and route is GgmlKernelRoute.DENSE_MV_EXT:
            diagnostic = "routemm has no mul_mv_ext kernel yet; quantized_matmul_ggml runs the mat-vec route instead"
        return result(
            route,
            None if runs else R.UNSUPPORTED_TYPE,
            diagnostic,
            executable=runs,
            weight_bytes=weight_bytes,
            d=1,
        )
    if inv.kind in (
        GgmlInvocationKind.EXPERT_AUTO_ALLOCATED,
        GgmlInvocationKind.EXPERT_FORCE_MV,
        GgmlInvocationKind.EXPERT_POOLED,
        GgmlInvocationKind.EXPERT_POOLED_PAIR,
        GgmlInvocationKind.EXPERT_SWIGLU_DOWN_Q4,
    ):
        e = inv.expert
        if e is None or min(e.n_tokens, e.n, e.k, e.top_k, e.n_experts) <= 0 or e.k % values:
            return result(code=R.INVALID_DIMENSIONS, diagnostic="expert shape needs positive dimensions")
        if not e.ids_within_expert_range or e.top_k > e.n_experts and e.ids_are_distinct_per_token:
            return result(code=R.INVALID_OPERATION_CONTRACT, diagnostic="expert ids break the call's contract")
        matrix = e.n * (e.k // values) * block
        if e.expert_stride_bytes < matrix:
            return result(code=R.INVALID_DIMENSIONS, diagnostic=f"expert stride {e.expert_stride_bytes} < {matrix}")
        weight_bytes = (e.n_experts - 1) * e.expert_stride_bytes + matrix
        mm = (
            inv.kind is not GgmlInvocationKind.EXPERT_FORCE_MV
            and e.n_tokens > policy.expert_mm_threshold
            and e.top_k in (1, 6, 8)
            and e.k >= 32
        )
        scratch = (
            GgmlExpertMmScratch(
                4 * e.n_experts,
                4 * e.n_experts * e.n_tokens,
                inv.kind is not GgmlInvocationKind.EXPERT_AUTO_ALLOCATED,
                inv.kind in (GgmlInvocationKind.EXPERT_POOLED, GgmlInvocationKind.EXPERT_POOLED_PAIR),
            )
            if mm
            else None
        )
        route = GgmlKernelRoute.EXPERT_MM_ID if mm else GgmlKernelRoute.EXPERT_MV_ID
        return result(
            route,
            R.UNSUPPORTED_TYPE,
            f"routemm has no quantised expert-ID {route.value} kernel for {type_name} yet "
            "(scalar expert stacks: dense_matmul_id)",
            weight_bytes=weight_bytes,
            scratch=scratch,
            d=2 if mm else 1,
            b=1 if mm else 0,
        )
    return result(
        code=R.UNSUPPORTED_REGIME,
        diagnostic=f"routemm has no {inv.kind.value} route yet",
    )
