"""GGML Q4_0 / Q8_0 dense projections: out[m, n] = input[m, k] @ dequantize(weight[n, k]).T.

The weight is a U8 buffer of raw GGUF blocks (n rows of k / 32 blocks of 18 bytes for Q4_0, 34
for Q8_0), input and output are F32 row-major. m <= 8 takes the mat-vec pipeline; for Q4_0, m > 8
takes one of four matrix routes (DenseQ4Route), chosen by the routing policy; Q8_0 has one matrix
route, compatibility_simdgroup. Every call returns a receipt that says which
route ran, why, under which policy, and the dispatch exactly as it was encoded.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
from typing import ClassVar, Optional

import numpy as np

from .. import _core
from ..core._core_api import EncodedKernelDispatch, check_encoding, check_type, check_uint
from ..core._errors import InvalidArgumentError
from ..core._json import JsonRecord
from ..core._record_checks import SchemaVersioned

SCHEMA_VERSION: int = _core.GGML_QUANTIZED_MATMUL_SCHEMA_VERSION
MM_ROUTING_THRESHOLD: int = _core.GGML_MM_ROUTING_THRESHOLD
Q4_MATMUL_PIPELINE_NAMES: tuple[str, ...] = _core.Q4_MATMUL_PIPELINE_NAMES
Q4_MAT_VEC_PIPELINE: str = Q4_MATMUL_PIPELINE_NAMES[0]
# Q8_0: the mat-vec (m <= 8) and the one matrix route (compatibility_simdgroup's, m > 8).
Q8_MATMUL_PIPELINE_NAMES: tuple[str, ...] = _core.Q8_MATMUL_PIPELINE_NAMES
# Q8_0's default mat-vec (GgmlRoutingPolicy.dense_q8_0_mv_nr2): threads [32, 4, 1], 2 rows per
# threadgroup, 256 bytes of threadgroup memory. Backends without it run Q8_MATMUL_PIPELINE_NAMES[0].
Q8_0_MAT_VEC_NR2_PIPELINE: str = _core.Q8_0_MAT_VEC_NR2_PIPELINE
# The reduced-precision int8-dot pipelines (GgmlRoutingPolicy.dense_int8_dot; the CPU has them):
# Q4_0 mat-vec, Q4_0 matrix, Q8_0 mat-vec, Q8_0 matrix (the K-quants' are kernel_mul_m{v,m}_q{4,5,6}_k_int8dot_f32).
# Receipts of their calls say route "int8_dot".
GGML_INT8_DOT_PIPELINE_NAMES: tuple[str, ...] = _core.GGML_INT8_DOT_PIPELINE_NAMES
INT8_DOT_ROUTE: str = _core.GGML_INT8_DOT_ROUTE
# The specialisation constants every Q4 pipeline is fetched with, as they appear in labels.
Q4_PIPELINE_LABEL_SUFFIX = "|700:i1|701:i1|702:i1"
MAT_VEC_ROUTE = "mat_vec"


class GgmlType(enum.Enum):
    """GGML block formats known by name; quantized_matmul_ggml supports Q4_0 and Q8_0."""

    Q4_0 = "q4_0"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q8_0 = "q8_0"
    Q2_K = "q2_k"
    Q3_K = "q3_k"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    IQ4_NL = "iq4_nl"
    IQ4_XS = "iq4_xs"
    Q4_1 = "q4_1"
    MXFP4 = "mxfp4"

    @property
    def block_layout(self) -> tuple[int, int]:
        """(values per block, bytes per block)."""
        return tuple(_core._ggml_block_layout(self.value))


class GgmlTensorMmPreference(enum.Enum):
    AUTO_PROBE = "auto_probe"  # tensor-API matrix kernels where the device has them
    FORCE_SIMD = "force_simd"  # always the simdgroup matrix kernel


class DenseQ4Route(enum.Enum):
    """The four matrix routes for m > 8, each its own pipeline."""

    COMPATIBILITY_SIMDGROUP = "compatibility_simdgroup"
    COMPATIBILITY_TENSOR_V1 = "compatibility_tensor_v1"
    COMPATIBILITY_V2 = "compatibility_v2"
    TENSOR_64X32 = "tensor_64x32"  # candidate: V2's arithmetic with a 32-token tile

    @classmethod
    def _missing_(cls, value):
        # Written as the pipeline names it; the reference's serde spelling is read as the same route.
        return cls.TENSOR_64X32 if value == "tensor64x32" else None

    @property
    def pipeline_name(self) -> str:
        return _core._dense_q4_pipeline_name(self.value)

    @property
    def pipeline_label(self) -> str:
        return self.pipeline_name + Q4_PIPELINE_LABEL_SUFFIX


class DenseQ4DecisionSource(enum.Enum):
    """Why a route was taken: spec §6.1's decision sources, plus MAT_VEC_THRESHOLD (m <= 8) and
    POLICY_INT8_DOT (a matrix call the policy sent to an int8-dot pipeline)."""

    MAT_VEC_THRESHOLD = "mat_vec_threshold"
    FROZEN_PLAN = "frozen_plan"
    NO_PLAN_COMPATIBILITY_FALLBACK = "no_plan_compatibility_fallback"
    UNDECLARED_COMPATIBILITY_FALLBACK = "undeclared_compatibility_fallback"
    INELIGIBLE_COMPATIBILITY_FALLBACK = "ineligible_compatibility_fallback"
    FORCED_TEST = "forced_test"
    POLICY_INT8_DOT = "policy_int8_dot"  # m > 8 under GgmlRoutingPolicy.dense_int8_dot


_FALSE_WORDS = ("0", "false", "off")
_TRUE_WORDS = ("1", "true", "on")
# The policy's registry plan kind: a registry carries at most one frozen policy (spec §3.3).
POLICY_KIND = "ggml_routing_policy"
# Default of expert_mm_threshold: expert calls with more tokens than this use the matrix route.
MM_ID_ROUTING_THRESHOLD = 8


def _env_flag(name: str, default: bool) -> bool:
    """A boolean knob: unset keeps `default`; a default-true knob is turned off by 0/false/off, a
    default-false one on by 1/true/on (any case)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in _FALSE_WORDS if default else value in _TRUE_WORDS


def _env_count(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        count = int(value, 10)
    except ValueError:
        count = -1
    if not 0 <= count <= 0xFFFFFFFF:
        raise InvalidArgumentError(f"{name} must be an integer in [0, 4294967295], got {value!r}")
    return count


@dataclasses.dataclass(frozen=True)
class GgmlRoutingPolicy(JsonRecord):
    """Which GGML kernel routes a call may take (spec §4.1). Explicit policies never read the
    environment; `from_environment()` reads it now; a registry may carry one frozen policy
    (`KernelRegistry.freeze_ggml_routing_policy`) that calls passing no policy use.

    `dense_tensor_mm` and `allow_dense_large_tile_mm` choose the dense Q4_0 matrix routes;
    `dense_q8_0_mv_nr2` makes Q8_0 mat-vec calls (m <= 8) run `kernel_mul_mv_q8_0_f32_nr2` where
    the backend has it (CPU, Metal), else `kernel_mul_mv_q8_0_f32` (the receipt's label says
    which). `dense_int8_dot` (off by default: reduced precision) makes every Q4_0 / Q8_0 / Q4_K /
    Q5_K / Q6_K call run the int8-dot pipeline of its regime where the backend has it (the CPU):
    activations rounded to int8 per 32-value block (256 for the K-quants), integer dot products,
    F32 accumulation, within the bound of
    docs/numerics.md; the receipt's route is then "int8_dot", elsewhere the exact routes run.
    `expert_mm_threshold` is the automatic expert-ID route's: it groups only calls of more than
    that many tokens (dense_matmul_id.auto_grouped). `expert_tensor_mm` = force_simd keeps the
    automatic expert-ID choices off tensor-core kernels: the MoE op's automatic route
    (torch.ops.routemm.moe_experts with exact=False) takes the exact rule, and the expert-ID
    calibrations leave the tensor-core candidates out. `expert_q8_0_mv_nr2` (off by default) makes
    Q8_0 expert-ID direct calls run `quantized_matmul_id_direct_q8_0_f32_nr2` where the backend
    has it (CPU, Metal): each routed row bit-identical to `kernel_mul_mv_q8_0_f32_nr2` on its
    expert (the expert-ID receipt's pipeline says which ran). The other fields (RECORDED_ONLY)
    name kernels routemm does not have -- K-quant width-mN tiles, mul_mv_ext, the Q6_K nr2
    mat-vecs: they are accepted, validated, recorded in every receipt and used by the structural
    planner (`plan_dense_auto_route`, `ggml_capability`), and change no dispatch."""

    SCHEMA = "ggml_routing_policy.schema.json"
    RECORDED_ONLY: ClassVar[tuple[str, ...]] = (
        "dense_decode_mvn",
        "dense_decode_mv_ext",
        "dense_q6k_mv_nr2",
        "expert_q6k_mv_nr2",
    )
    dense_tensor_mm: GgmlTensorMmPreference = GgmlTensorMmPreference.AUTO_PROBE
    allow_dense_large_tile_mm: bool = True
    dense_decode_mvn: bool = True  # K-quants at M in [2, 8]: bit-identical multi-column tiles
    dense_decode_mv_ext: bool = False  # opt-in mul_mv_ext at M in [2, 8] (not bit-identical)
    dense_q6k_mv_nr2: bool = True
    dense_q8_0_mv_nr2: bool = True
    dense_int8_dot: bool = False  # opt-in int8-dot routes (reduced precision; CPU)
    expert_mm_threshold: int = MM_ID_ROUTING_THRESHOLD  # expert matrix route when n_tokens > this
    expert_q6k_mv_nr2: bool = True
    expert_q8_0_mv_nr2: bool = False
    expert_tensor_mm: GgmlTensorMmPreference = GgmlTensorMmPreference.AUTO_PROBE

    def __post_init__(self) -> None:
        # A policy is what receipts record: no truthy stand-ins ("no" would read as True).
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("tensor_mm"):
                try:
                    GgmlTensorMmPreference(value)
                except (ValueError, TypeError):
                    choices = ", ".join(repr(p.value) for p in GgmlTensorMmPreference)
                    raise InvalidArgumentError(
                        f"GgmlRoutingPolicy {f.name} must be one of {choices}, got {value!r}"
                    ) from None
            elif f.name == "expert_mm_threshold":
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 0xFFFFFFFF:
                    raise InvalidArgumentError(f"GgmlRoutingPolicy expert_mm_threshold must be a u32, got {value!r}")
            elif not isinstance(value, (bool, np.bool_)):
                raise InvalidArgumentError(f"GgmlRoutingPolicy {f.name} must be a bool, got {value!r}")

    @classmethod
    def from_environment(cls) -> "GgmlRoutingPolicy":
        """The policy the environment asks for, read now (the knobs are in routemm.env's table):
        ROUTEMM_DISABLE_TENSOR_MM=1 forces the simdgroup kernel; ROUTEMM_LARGE_TILE_MM=0/false/off
        forbids the large tile; the recorded-only fields have their own ROUTEMM_* knobs."""
        force_simd = os.environ.get("ROUTEMM_DISABLE_TENSOR_MM", "").strip() == "1"
        force_simd_id = os.environ.get("ROUTEMM_DISABLE_TENSOR_MM_ID", "").strip() == "1"
        simd, auto = GgmlTensorMmPreference.FORCE_SIMD, GgmlTensorMmPreference.AUTO_PROBE
        return cls(
            dense_tensor_mm=simd if force_simd else auto,
            allow_dense_large_tile_mm=_env_flag("ROUTEMM_LARGE_TILE_MM", True),
            dense_decode_mvn=_env_flag("ROUTEMM_DECODE_MVN", True),
            dense_decode_mv_ext=_env_flag("ROUTEMM_DECODE_MV_EXT", False),
            dense_q6k_mv_nr2=_env_flag("ROUTEMM_Q6K_MV_NR2", True),
            dense_q8_0_mv_nr2=_env_flag("ROUTEMM_Q8_0_MV_NR2", True),
            dense_int8_dot=_env_flag("ROUTEMM_DENSE_INT8_DOT", False),
            expert_mm_threshold=_env_count("ROUTEMM_MM_ID_ROUTING_THRESHOLD", MM_ID_ROUTING_THRESHOLD),
            expert_q6k_mv_nr2=_env_flag("ROUTEMM_Q6K_ID_MV_NR2", True),
            expert_q8_0_mv_nr2=_env_flag("ROUTEMM_Q8_0_ID_MV_NR2", False),
            expert_tensor_mm=simd if force_simd_id else auto,
        )

    def _native(self) -> tuple[str, bool, bool, bool]:
        return (
            GgmlTensorMmPreference(self.dense_tensor_mm).value,
            bool(self.allow_dense_large_tile_mm),
            bool(self.dense_q8_0_mv_nr2),
            bool(self.dense_int8_dot),
        )


def freeze_ggml_routing_policy(registry, policy: GgmlRoutingPolicy) -> None:
    """Bind `policy` to `registry` for good: calls on it that pass no policy use it (spec §3.3).
    One-shot like a route plan: the same policy again is a no-op, a different one is refused."""
    if not isinstance(policy, GgmlRoutingPolicy):
        raise InvalidArgumentError(f"freeze_ggml_routing_policy needs a GgmlRoutingPolicy, got {policy!r}")
    document = policy.to_json()
    policy_id = hashlib.sha256(document.encode()).hexdigest()
    existing = registry.frozen_plan_id(POLICY_KIND)
    if existing is not None and existing != policy_id:
        raise InvalidArgumentError(f"ggml routing policy is already frozen in this registry as {existing}")
    registry.freeze_plan(POLICY_KIND, policy_id, [], document)


def ggml_routing_policy(registry) -> Optional[GgmlRoutingPolicy]:
    """The policy frozen into `registry`, or None (calls then read the environment)."""
    document = registry.frozen_plan_document(POLICY_KIND)
    return None if document is None else _policy_from_document(document)


@functools.lru_cache(maxsize=64)
def _policy_from_document(document: str) -> GgmlRoutingPolicy:
    return GgmlRoutingPolicy.from_json(document)


def effective_policy(registry, routing: Optional[GgmlRoutingPolicy], op: str) -> GgmlRoutingPolicy:
    """The policy a call runs under: its own, else the registry's frozen one, else the environment."""
    if routing is None:
        routing = ggml_routing_policy(registry) or GgmlRoutingPolicy.from_environment()
    if not isinstance(routing, GgmlRoutingPolicy):
        raise InvalidArgumentError(f"{op} routing must be a GgmlRoutingPolicy, got {routing!r}")
    return routing


_core.KernelRegistry.freeze_ggml_routing_policy = freeze_ggml_routing_policy
_core.KernelRegistry.ggml_routing_policy = ggml_routing_policy


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulParams(JsonRecord, SchemaVersioned):
    """m = input rows (tokens), n = output features (weight rows), k = input width."""

    SCHEMA = "ggml_quantized_matmul_params.schema.json"
    m: int
    n: int
    k: int
    ggml_type: GgmlType = GgmlType.Q4_0
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        super().__post_init__()
        self._native()  # the fields are checked at construction, not at the first call

    def _native(self) -> _core._GgmlQuantizedMatmulParams:
        m, n, k = (check_uint("quantized_matmul_ggml", name, getattr(self, name)) for name in ("m", "n", "k"))
        return _core._GgmlQuantizedMatmulParams(m, n, k, GgmlType(self.ggml_type).value)


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulReceipt(JsonRecord, SchemaVersioned):
    """What one call encoded. route is a DenseQ4Route value, "mat_vec" or "int8_dot" (an int8-dot
    pipeline, mat-vec or matrix: the label says which)."""

    SCHEMA = "ggml_quantized_matmul_receipt.schema.json"
    ggml_type: GgmlType
    route: str
    decision: DenseQ4DecisionSource
    policy: GgmlRoutingPolicy
    pipeline_label: str
    dispatch_count: int
    dispatch: EncodedKernelDispatch
    schema_version: int = SCHEMA_VERSION

    @property
    def dense_route(self) -> Optional[DenseQ4Route]:
        """The matrix route, or None for the mat-vec and int8-dot pipelines."""
        return None if self.route in (MAT_VEC_ROUTE, INT8_DOT_ROUTE) else DenseQ4Route(self.route)

    @classmethod
    def _from_core(cls, d: dict) -> "GgmlQuantizedMatmulReceipt":
        return cls(
            ggml_type=GgmlType(d["ggml_type"]),
            route=d["route"],
            decision=DenseQ4DecisionSource(d["decision"]),
            policy=GgmlRoutingPolicy(
                GgmlTensorMmPreference(d["policy"]["dense_tensor_mm"]),
                d["policy"]["allow_dense_large_tile_mm"],
                dense_q8_0_mv_nr2=d["policy"]["dense_q8_0_mv_nr2"],
                dense_int8_dot=d["policy"]["dense_int8_dot"],
            ),
            pipeline_label=d["pipeline_label"],
            dispatch_count=d["dispatch_count"],
            dispatch=EncodedKernelDispatch._from_core(d["dispatch"]),
        )


def select_dense_q4_route(
    params: GgmlQuantizedMatmulParams, policy: GgmlRoutingPolicy
) -> tuple[DenseQ4Route, DenseQ4DecisionSource]:
    """Spec §6.2 route selection without a frozen plan (pure: no device, no environment)."""
    route, decision = _core._select_dense_q4_route(params._native(), *policy._native())
    return DenseQ4Route(route), DenseQ4DecisionSource(decision)


def q4_expected_dispatch(
    route: DenseQ4Route, m: int, n: int, *, registry=None, k: Optional[int] = None
) -> EncodedKernelDispatch:
    """The geometry a route's dispatch must have for m tokens and n outputs.

    Without ``registry``: the reference geometry of spec §6.2 (the CPU backend's, and Metal's).
    With ``registry`` (and ``k``, the input width): the geometry that registry's pipeline encodes,
    derived from its kernel definition exactly as the op does -- on CUDA the tiles differ from the
    reference and grid.z carries the K split, which depends on k.
    """
    route = DenseQ4Route(route)
    if registry is None:
        return EncodedKernelDispatch._from_core(_core._q4_expected_dispatch(route.value, int(m), int(n)))
    if k is None:
        raise InvalidArgumentError("q4_expected_dispatch with a registry needs k (the input width)")
    return EncodedKernelDispatch._from_core(
        _core._q4_registry_expected_dispatch(registry, route.value, int(m), int(n), int(k))
    )


def quantized_matmul_ggml(
    encoder,
    registry,
    input,
    weight,
    output,
    params: GgmlQuantizedMatmulParams,
    routing: Optional[GgmlRoutingPolicy] = None,
) -> GgmlQuantizedMatmulReceipt:
    """Encode out = input @ dequantize(weight).T into `encoder` (run with commit_and_wait()).

    routing=None uses the policy frozen into `registry`, else GgmlRoutingPolicy.from_environment().
    m > 8 consults the route plan frozen into `registry` (dense_q4_plan): a declared shape takes
    the plan's route; the receipt's `decision` says why the route was taken. Every validation
    happens before anything is encoded; on error the encoder is untouched.
    """
    _check_call("quantized_matmul_ggml", encoder, registry, input, weight, output, params)
    policy = effective_policy(registry, routing, "quantized_matmul_ggml")
    params._native()  # validates m, n, k
    return encode_ggml(encoder, registry, input, weight, output, params, policy)


def encode_ggml(
    encoder, registry, input, weight, output, params: GgmlQuantizedMatmulParams, policy: GgmlRoutingPolicy, device=None
) -> GgmlQuantizedMatmulReceipt:
    """The native dispatcher: with the policy's dense_int8_dot and a backend that has it, the int8-dot
    pipeline of the call's type and regime; otherwise the mat-vec pipeline for m <= 8 (Q8_0: the
    nr2 one when the policy's dense_q8_0_mv_nr2 is set and the backend has it), else the route the policy, the route
    plan frozen into `registry` (honoured only when made on `device`, by default the registry's)
    and the backend's pipelines give (spec §5.6, §6.2); the receipt's decision says why."""
    native = _core._quantized_matmul_ggml(
        encoder, registry, input, weight, output, params._native(), *policy._native(), device=device
    )
    return dataclasses.replace(GgmlQuantizedMatmulReceipt._from_core(native), policy=policy)


def encode_q4_route(
    encoder, registry, input, weight, output, params: GgmlQuantizedMatmulParams, route: DenseQ4Route
) -> GgmlQuantizedMatmulReceipt:
    """Encode exactly `route` (calibration and tests): Q4_0 and m > 8 only, one dispatch whose
    geometry equals q4_expected_dispatch(route, m, n, registry=registry, k=k)."""
    _check_call("encode_q4_route", encoder, registry, input, weight, output, params)
    native = _core._encode_q4_route(
        encoder, registry, input, weight, output, params._native(), DenseQ4Route(route).value
    )
    return GgmlQuantizedMatmulReceipt._from_core(native)


def _check_call(op: str, encoder, registry, input, weight, output, params) -> None:
    """The argument types of the dense projection's front doors (see _core_api.check_type)."""
    check_encoding(op, encoder, registry, ("input", "weight", "output"), input, weight, output)
    check_type(op, "params", params, GgmlQuantizedMatmulParams)
