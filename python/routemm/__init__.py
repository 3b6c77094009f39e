"""routemm: native kernels for LLM inference with explicit, receipted routing.

Backends: cpu (always), cuda and metal (when built and present). See README.md for the API.

The package is one sub-package per layer, each importing only the layers below it (checked by
import-linter, pyproject.toml); docs/architecture.md draws them:

    cli, integrations   `python -m routemm` and its demos; torch ops, transformers experts
    models              MoeLayer: a model's MoE layer from a GGUF file
    plans               calibration and frozen route plans
    ops                 expert-ID and quantised matmuls, the MoE gate and experts
    formats             GGML block formats, GGUF reading
    core                native types, errors, env knobs, JSON records and schemas, interop

The names below come from core, formats, ops, plans and models, as the import groups say. Module
paths of the flat layout that users import stay as small faces at the top, each naming the module
of its layer: routemm.torch, q4_0, q8_0, env, schemas, calibration, dense_matmul_id, __main__.
"""

# No `from __future__ import annotations` here: it would bind `annotations` in the public namespace.
import logging as _logging
import os as _os

from . import _core

# routemm.dense_matmul_id is both a module path (a face) and the function bound below: the face
# is loaded first, so that the function keeps the name. An import `x as x` below keeps a module
# name that the flat layout gave routemm (`from routemm import moe`).
from . import dense_matmul_id as _dense_matmul_id_module  # noqa: F401

# core
from .core import env, schemas
from .core._core_api import (
    CapturedNode,
    DispatchKind,
    DType,
    EncodedKernelDispatch,
    PipelineIdentity,
    dtype_of,
    numpy_dtype,
)
from .core._errors import (
    CalibrationError,
    CommandBufferError,
    Error,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    KernelNotFoundError,
    MissingDependencyError,
    OutOfMemoryError,
    UnsupportedError,
)
from .core._interop import from_dlpack

# formats
from .formats import gguf_io as gguf_io
from .formats import q4_0, q8_0
from .formats.ggml import dequantize, quantize
from .formats.gguf_io import gguf_metadata, gguf_tensor

# models
from .models import moe_layer as moe_layer
from .models.moe_layer import MoeLayer

# ops
from .ops import ggml_routes as ggml_routes
from .ops import moe as moe
from .ops import quantized_matmul as quantized_matmul
from .ops import quantized_matmul_id as quantized_matmul_id
from .ops.dense_matmul_id import (
    DenseMatmulIdCapability,
    DenseMatmulIdDispatchReceipt,
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    DenseMatmulIdScratch,
    DenseMatmulIdScratchRequirement,
    dense_matmul_id,
    dense_matmul_id_capability,
)
from .ops.ggml_routes import (
    GgmlCapability,
    GgmlCapabilityRequest,
    GgmlExpertShape,
    GgmlInvocation,
    GgmlInvocationKind,
    GgmlKernelRoute,
    GgmlRejectionCode,
    GgmlWorkload,
    ggml_capability,
    plan_dense_auto_route,
)
from .ops.matmul_id import matmul_id
from .ops.moe import (
    MOE_PIPELINE_NAMES,
    encode_moe_combine,
    encode_moe_gate,
    encode_moe_silu_mul,
    moe_experts,
    moe_gate,
)
from .ops.quantized_matmul import (
    GGML_INT8_DOT_PIPELINE_NAMES,
    Q4_MATMUL_PIPELINE_NAMES,
    Q8_0_MAT_VEC_NR2_PIPELINE,
    Q8_MATMUL_PIPELINE_NAMES,
    DenseQ4DecisionSource,
    DenseQ4Route,
    GgmlQuantizedMatmulParams,
    GgmlQuantizedMatmulReceipt,
    GgmlRoutingPolicy,
    GgmlTensorMmPreference,
    GgmlType,
    encode_q4_route,
    freeze_ggml_routing_policy,
    ggml_routing_policy,
    q4_expected_dispatch,
    quantized_matmul_ggml,
    select_dense_q4_route,
)
from .ops.quantized_matmul_id import (
    GgmlQuantizedMatmulIdCapability,
    GgmlQuantizedMatmulIdDispatchReceipt,
    GgmlQuantizedMatmulIdParams,
    GgmlQuantizedMatmulIdRoute,
    quantized_matmul_id_ggml,
    quantized_matmul_id_ggml_capability,
)

# plans
from .plans import calibration
from .plans import dense_matmul_id_plan as dense_matmul_id_plan
from .plans import dense_q4_plan as dense_q4_plan
from .plans import quantized_matmul_id_plan as quantized_matmul_id_plan
from .plans.dense_matmul_id_plan import (
    DENSE_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM,
    DenseMatmulIdAutoReceipt,
    DenseMatmulIdCalibrationCase,
    DenseMatmulIdCalibrationDecision,
    DenseMatmulIdCalibrationLimits,
    DenseMatmulIdCalibrationReceipt,
    DenseMatmulIdDecisionSource,
    DenseMatmulIdDispatchTrace,
    DenseMatmulIdRoutePlan,
    DenseMatmulIdRoutingProfile,
    DenseMatmulIdSelectionStatus,
    DenseMatmulIdShape,
    calibrate_dense_matmul_id_routes,
    dense_matmul_id_auto,
    dense_matmul_id_expected_dispatches,
    freeze_dense_matmul_id_plan,
    freeze_dense_matmul_id_plan_for_cases,
    load_dense_matmul_id_plan,
    resolve_dense_matmul_id_auto_route,
    trace_dense_matmul_id,
    trace_dense_matmul_id_auto,
)
from .plans.dense_q4_plan import (
    DENSE_Q4_RECEIPT_SCHEMA_VERSION,
    DENSE_Q4_ROUTE_SCHEMA_VERSION,
    DenseQ4BaseShape,
    DenseQ4CalibrationBatchReceipt,
    DenseQ4CalibrationCase,
    DenseQ4CalibrationDecision,
    DenseQ4CalibrationLimits,
    DenseQ4CartesianAcceptanceRequirements,
    DenseQ4DispatchDecision,
    DenseQ4DispatchTrace,
    DenseQ4InputLayout,
    DenseQ4RoutePlan,
    DenseQ4RouteTiming,
    DenseQ4SelectionStatus,
    DenseQ4Shape,
    DenseQ4TimingDistribution,
    calibrate_dense_q4_routes,
    dense_q4_auto,
    freeze_dense_q4_plan,
    load_dense_q4_plan,
    trace_dense_q4_auto,
    validate_dense_q4_cartesian_acceptance,
)
from .plans.quantized_matmul_id_plan import (
    QUANTIZED_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM,
    GgmlQuantizedMatmulIdAutoReceipt,
    GgmlQuantizedMatmulIdCalibrationCase,
    GgmlQuantizedMatmulIdCalibrationDecision,
    GgmlQuantizedMatmulIdCalibrationLimits,
    GgmlQuantizedMatmulIdCalibrationReceipt,
    GgmlQuantizedMatmulIdRoutePlan,
    GgmlQuantizedMatmulIdShape,
    calibrate_quantized_matmul_id_routes,
    freeze_quantized_matmul_id_plan,
    load_quantized_matmul_id_plan,
    quantized_matmul_id_ggml_auto,
    resolve_quantized_matmul_id_auto_route,
)

Device = _core.Device
Buffer = _core.Buffer
CommandEncoder = _core.CommandEncoder
CapturedGraph = _core.CapturedGraph
GraphExec = _core.GraphExec
GraphSession = _core.GraphSession
KernelRegistry = _core.KernelRegistry
Pipeline = _core.Pipeline
available_backends = _core.available_backends
dispatch_count = _core.dispatch_count
encoder_counters = _core.encoder_counters
reset_encoder_counters = _core.reset_encoder_counters
DENSE_MATMUL_ID_PIPELINE_NAMES = _core.DENSE_MATMUL_ID_PIPELINE_NAMES
DENSE_MATMUL_ID_SCHEMA_VERSION = _core.DENSE_MATMUL_ID_SCHEMA_VERSION
DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES = _core.DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES
DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES = _core.DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES
GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES = _core.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES
GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES = _core.GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES
GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES = _core.GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES
GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE = _core.GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE

__version__ = _core.version()

logger = _logging.getLogger("routemm")
logger.addHandler(_logging.NullHandler())


def _apply_log_level(value: str) -> None:
    """ROUTEMM_LOG_LEVEL: a level name (any case) or number. Anything else is a warning and is
    ignored: a misspelt knob must not stop the library from importing."""
    level = value.strip().upper()
    try:
        logger.setLevel(int(level) if level.isdigit() else level)
    except (ValueError, TypeError):
        import warnings as _warnings

        _warnings.warn(
            f"routemm: ignoring ROUTEMM_LOG_LEVEL={value!r} (not a logging level)", RuntimeWarning, stacklevel=2
        )


if _os.environ.get("ROUTEMM_LOG_LEVEL"):
    _apply_log_level(_os.environ["ROUTEMM_LOG_LEVEL"])


def backend_status() -> list[tuple[str, bool, str]]:
    """(name, available, reason) for every backend this build knows, best first."""
    return [tuple(row) for row in _core.backend_status()]


__all__ = [
    "Buffer",
    "CalibrationError",
    "CapturedGraph",
    "CapturedNode",
    "CommandBufferError",
    "CommandEncoder",
    "DENSE_MATMUL_ID_PIPELINE_NAMES",
    "DENSE_MATMUL_ID_SCHEMA_VERSION",
    "DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES",
    "DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES",
    "DType",
    "DenseMatmulIdCapability",
    "DenseMatmulIdDispatchReceipt",
    "DenseMatmulIdInputLayout",
    "DenseMatmulIdMultiplicity",
    "DenseMatmulIdParams",
    "DenseMatmulIdRoute",
    "DenseMatmulIdScratch",
    "DenseMatmulIdScratchRequirement",
    "Device",
    "DispatchKind",
    "EncodedKernelDispatch",
    "Error",
    "GraphExec",
    "GraphSession",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "KernelNotFoundError",
    "KernelRegistry",
    "MissingDependencyError",
    "OutOfMemoryError",
    "Pipeline",
    "PipelineIdentity",
    "UnsupportedError",
    "available_backends",
    "backend_status",
    "dense_matmul_id",
    "dense_matmul_id_capability",
    "dispatch_count",
    "from_dlpack",
    "dtype_of",
    "encoder_counters",
    "env",
    "matmul_id",
    "numpy_dtype",
    "reset_encoder_counters",
    "schemas",
]
__all__ += [
    "DenseQ4DecisionSource",
    "DenseQ4Route",
    "GgmlQuantizedMatmulParams",
    "GgmlQuantizedMatmulReceipt",
    "GgmlRoutingPolicy",
    "GgmlTensorMmPreference",
    "GgmlType",
    "GGML_INT8_DOT_PIPELINE_NAMES",
    "Q4_MATMUL_PIPELINE_NAMES",
    "Q8_0_MAT_VEC_NR2_PIPELINE",
    "Q8_MATMUL_PIPELINE_NAMES",
    "encode_q4_route",
    "freeze_ggml_routing_policy",
    "ggml_routing_policy",
    "gguf_tensor",
    "q4_0",
    "q8_0",
    "quantize",
    "dequantize",
    "q4_expected_dispatch",
    "quantized_matmul_ggml",
    "select_dense_q4_route",
    "GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES",
    "GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES",
    "GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES",
    "GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE",
    "GgmlQuantizedMatmulIdCapability",
    "GgmlQuantizedMatmulIdDispatchReceipt",
    "GgmlQuantizedMatmulIdParams",
    "GgmlQuantizedMatmulIdRoute",
    "quantized_matmul_id_ggml",
    "quantized_matmul_id_ggml_capability",
]
__all__ += [
    "MOE_PIPELINE_NAMES",
    "encode_moe_combine",
    "encode_moe_gate",
    "encode_moe_silu_mul",
    "moe_experts",
    "moe_gate",
    "MoeLayer",
    "gguf_metadata",
]


__all__ += [
    "DENSE_Q4_RECEIPT_SCHEMA_VERSION",
    "DENSE_Q4_ROUTE_SCHEMA_VERSION",
    "DenseQ4BaseShape",
    "DenseQ4CalibrationBatchReceipt",
    "DenseQ4CalibrationCase",
    "DenseQ4CalibrationDecision",
    "DenseQ4CalibrationLimits",
    "DenseQ4CartesianAcceptanceRequirements",
    "DenseQ4DispatchDecision",
    "DenseQ4DispatchTrace",
    "DenseQ4InputLayout",
    "DenseQ4RoutePlan",
    "DenseQ4RouteTiming",
    "DenseQ4SelectionStatus",
    "DenseQ4Shape",
    "DenseQ4TimingDistribution",
    "calibrate_dense_q4_routes",
    "calibration",
    "dense_q4_auto",
    "freeze_dense_q4_plan",
    "load_dense_q4_plan",
    "trace_dense_q4_auto",
    "validate_dense_q4_cartesian_acceptance",
    "DENSE_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM",
    "DenseMatmulIdAutoReceipt",
    "DenseMatmulIdCalibrationCase",
    "DenseMatmulIdCalibrationDecision",
    "DenseMatmulIdCalibrationLimits",
    "DenseMatmulIdCalibrationReceipt",
    "DenseMatmulIdDecisionSource",
    "DenseMatmulIdRoutePlan",
    "DenseMatmulIdRoutingProfile",
    "DenseMatmulIdSelectionStatus",
    "DenseMatmulIdShape",
    "calibrate_dense_matmul_id_routes",
    "dense_matmul_id_auto",
    "freeze_dense_matmul_id_plan",
    "load_dense_matmul_id_plan",
    "freeze_dense_matmul_id_plan_for_cases",
    "DenseMatmulIdDispatchTrace",
    "dense_matmul_id_expected_dispatches",
    "resolve_dense_matmul_id_auto_route",
    "trace_dense_matmul_id",
    "trace_dense_matmul_id_auto",
    "QUANTIZED_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM",
    "GgmlQuantizedMatmulIdAutoReceipt",
    "GgmlQuantizedMatmulIdCalibrationCase",
    "GgmlQuantizedMatmulIdCalibrationDecision",
    "GgmlQuantizedMatmulIdCalibrationLimits",
    "GgmlQuantizedMatmulIdCalibrationReceipt",
    "GgmlQuantizedMatmulIdRoutePlan",
    "GgmlQuantizedMatmulIdShape",
    "calibrate_quantized_matmul_id_routes",
    "freeze_quantized_matmul_id_plan",
    "load_quantized_matmul_id_plan",
    "quantized_matmul_id_ggml_auto",
    "resolve_quantized_matmul_id_auto_route",
    "GgmlCapability",
    "GgmlCapabilityRequest",
    "GgmlExpertShape",
    "GgmlInvocation",
    "GgmlInvocationKind",
    "GgmlKernelRoute",
    "GgmlRejectionCode",
    "GgmlWorkload",
    "ggml_capability",
    "plan_dense_auto_route",
]
