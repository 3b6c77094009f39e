"""GGML Q4_0 dense projections: out[m, n] = input[m, k] @ dequantize(weight[n, k]).T.

The weight is a U8 buffer of raw GGUF Q4_0 blocks (n rows of k / 32 blocks of 18 bytes), input
and output are F32 row-major. m <= 8 takes the mat-vec pipeline; m > 8 takes one of four matrix
routes (DenseQ4Route), chosen by the routing policy. Every call returns a receipt that says which
route ran, why, under which policy, and the dispatch exactly as it was encoded.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Optional

import numpy as np

from . import _core
from ._core_api import EncodedKernelDispatch
from ._errors import InvalidArgumentError
from ._json import JsonRecord
from ._record_checks import SchemaVersioned

SCHEMA_VERSION: int = _core.GGML_QUANTIZED_MATMUL_SCHEMA_VERSION
MM_ROUTING_THRESHOLD: int = _core.GGML_MM_ROUTING_THRESHOLD
Q4_MATMUL_PIPELINE_NAMES: tuple[str, ...] = _core.Q4_MATMUL_PIPELINE_NAMES
Q4_MAT_VEC_PIPELINE: str = Q4_MATMUL_PIPELINE_NAMES[0]
# The specialisation constants every Q4 pipeline is fetched with, as they appear in labels.
Q4_PIPELINE_LABEL_SUFFIX = "|700:i1|701:i1|702:i1"
MAT_VEC_ROUTE = "mat_vec"


class GgmlType(enum.Enum):
    """GGML block formats known by name; quantized_matmul_ggml supports Q4_0."""

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

    @property
    def pipeline_name(self) -> str:
        return _core._dense_q4_pipeline_name(self.value)

    @property
    def pipeline_label(self) -> str:
        return self.pipeline_name + Q4_PIPELINE_LABEL_SUFFIX


class DenseQ4DecisionSource(enum.Enum):
    """Why a route was taken: spec §6.1's decision sources, plus MAT_VEC_THRESHOLD (m <= 8)."""

    MAT_VEC_THRESHOLD = "mat_vec_threshold"
    FROZEN_PLAN = "frozen_plan"
    NO_PLAN_COMPATIBILITY_FALLBACK = "no_plan_compatibility_fallback"
    UNDECLARED_COMPATIBILITY_FALLBACK = "undeclared_compatibility_fallback"
    INELIGIBLE_COMPATIBILITY_FALLBACK = "ineligible_compatibility_fallback"
    FORCED_TEST = "forced_test"


_FALSE_WORDS = ("0", "false", "off")


@dataclasses.dataclass(frozen=True)
class GgmlRoutingPolicy(JsonRecord):
    """The dense routing policy. Explicit policies never read the environment."""

    SCHEMA = "ggml_routing_policy.schema.json"
    dense_tensor_mm: GgmlTensorMmPreference = GgmlTensorMmPreference.AUTO_PROBE
    allow_dense_large_tile_mm: bool = True

    def __post_init__(self) -> None:
        # A policy is what receipts record: no truthy stand-ins ("no" would read as True).
        try:
            GgmlTensorMmPreference(self.dense_tensor_mm)
        except (ValueError, TypeError):
            choices = ", ".join(repr(p.value) for p in GgmlTensorMmPreference)
            raise InvalidArgumentError(
                f"GgmlRoutingPolicy dense_tensor_mm must be one of {choices}, got {self.dense_tensor_mm!r}"
            ) from None
        if not isinstance(self.allow_dense_large_tile_mm, (bool, np.bool_)):
            raise InvalidArgumentError(
                f"GgmlRoutingPolicy allow_dense_large_tile_mm must be a bool, got {self.allow_dense_large_tile_mm!r}"
            )

    @classmethod
    def from_environment(cls) -> "GgmlRoutingPolicy":
        """The policy the environment asks for, read now: ROUTEMM_DISABLE_TENSOR_MM=1 forces the
        simdgroup kernel; ROUTEMM_LARGE_TILE_MM=0/false/off (any case) forbids the large tile."""
        force_simd = os.environ.get("ROUTEMM_DISABLE_TENSOR_MM", "").strip() == "1"
        no_large = os.environ.get("ROUTEMM_LARGE_TILE_MM", "").strip().lower() in _FALSE_WORDS
        return cls(GgmlTensorMmPreference.FORCE_SIMD if force_simd else GgmlTensorMmPreference.AUTO_PROBE, not no_large)

    def _native(self) -> tuple[str, bool]:
        return GgmlTensorMmPreference(self.dense_tensor_mm).value, bool(self.allow_dense_large_tile_mm)


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulParams(JsonRecord, SchemaVersioned):
    """m = input rows (tokens), n = output features (weight rows), k = input width."""

    SCHEMA = "ggml_quantized_matmul_params.schema.json"
    m: int
    n: int
    k: int
    ggml_type: GgmlType = GgmlType.Q4_0
    schema_version: int = SCHEMA_VERSION

    def _native(self) -> _core._GgmlQuantizedMatmulParams:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 0xFFFFFFFF:
                raise InvalidArgumentError(f"quantized_matmul_ggml {name} must be a u32, got {value!r}")
        return _core._GgmlQuantizedMatmulParams(int(self.m), int(self.n), int(self.k), GgmlType(self.ggml_type).value)


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulReceipt(JsonRecord, SchemaVersioned):
    """What one call encoded. route is a DenseQ4Route value or "mat_vec"."""

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
        """The matrix route, or None for the mat-vec pipeline."""
        return None if self.route == MAT_VEC_ROUTE else DenseQ4Route(self.route)

    @classmethod
    def _from_core(cls, d: dict) -> "GgmlQuantizedMatmulReceipt":
        return cls(
            ggml_type=GgmlType(d["ggml_type"]),
            route=d["route"],
            decision=DenseQ4DecisionSource(d["decision"]),
            policy=GgmlRoutingPolicy(
                GgmlTensorMmPreference(d["policy"]["dense_tensor_mm"]), d["policy"]["allow_dense_large_tile_mm"]
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

    routing=None uses GgmlRoutingPolicy.from_environment(). Every validation happens before
    anything is encoded; on error the encoder is untouched.
    """
    policy = GgmlRoutingPolicy.from_environment() if routing is None else routing
    if not isinstance(policy, GgmlRoutingPolicy):
        raise InvalidArgumentError(f"quantized_matmul_ggml routing must be a GgmlRoutingPolicy, got {policy!r}")
    native = _core._quantized_matmul_ggml(encoder, registry, input, weight, output, params._native(), *policy._native())
    return GgmlQuantizedMatmulReceipt._from_core(native)


def encode_q4_route(
    encoder, registry, input, weight, output, params: GgmlQuantizedMatmulParams, route: DenseQ4Route
) -> GgmlQuantizedMatmulReceipt:
    """Encode exactly `route` (calibration and tests): Q4_0 and m > 8 only, one dispatch whose
    geometry equals q4_expected_dispatch(route, m, n, registry=registry, k=k)."""
    native = _core._encode_q4_route(
        encoder, registry, input, weight, output, params._native(), DenseQ4Route(route).value
    )
    return GgmlQuantizedMatmulReceipt._from_core(native)
