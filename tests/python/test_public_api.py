"""routemm's public names and module paths: every name importable from routemm and every module
path the docs name keep working, whichever layer holds them."""

import importlib
import subprocess
import sys

import pytest
import routemm

# `sorted(n for n in dir(routemm) if not n.startswith("_"))` after a fresh `import routemm`, in
# order: the names of the flat layout, and the layers' sub-packages (core, formats, models, ops, plans).
PUBLIC_NAMES = """
    Buffer CalibrationError CapturedGraph CapturedNode CommandBufferError CommandEncoder
    DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES DENSE_MATMUL_ID_PIPELINE_NAMES
    DENSE_MATMUL_ID_SCHEMA_VERSION DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES
    DENSE_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM DENSE_Q4_RECEIPT_SCHEMA_VERSION
    DENSE_Q4_ROUTE_SCHEMA_VERSION DType DenseMatmulIdAutoReceipt DenseMatmulIdCalibrationCase
    DenseMatmulIdCalibrationDecision DenseMatmulIdCalibrationLimits
    DenseMatmulIdCalibrationReceipt DenseMatmulIdCapability DenseMatmulIdDecisionSource
    DenseMatmulIdDispatchReceipt DenseMatmulIdDispatchTrace DenseMatmulIdInputLayout
    DenseMatmulIdMultiplicity DenseMatmulIdParams DenseMatmulIdRoute DenseMatmulIdRoutePlan
    DenseMatmulIdRoutingProfile DenseMatmulIdScratch DenseMatmulIdScratchRequirement
    DenseMatmulIdSelectionStatus DenseMatmulIdShape DenseQ4BaseShape
    DenseQ4CalibrationBatchReceipt DenseQ4CalibrationCase DenseQ4CalibrationDecision
    DenseQ4CalibrationLimits DenseQ4CartesianAcceptanceRequirements DenseQ4DecisionSource
    DenseQ4DispatchDecision DenseQ4DispatchTrace DenseQ4InputLayout DenseQ4Route
    DenseQ4RoutePlan DenseQ4RouteTiming DenseQ4SelectionStatus DenseQ4Shape
    DenseQ4TimingDistribution Device DispatchKind EncodedKernelDispatch Error
    GGML_INT8_DOT_PIPELINE_NAMES GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES
    GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE
    GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES
    GgmlCapability GgmlCapabilityRequest GgmlExpertShape GgmlInvocation GgmlInvocationKind
    GgmlKernelRoute GgmlQuantizedMatmulIdAutoReceipt GgmlQuantizedMatmulIdCalibrationCase
    GgmlQuantizedMatmulIdCalibrationDecision GgmlQuantizedMatmulIdCalibrationLimits
    GgmlQuantizedMatmulIdCalibrationReceipt GgmlQuantizedMatmulIdCapability
    GgmlQuantizedMatmulIdDispatchReceipt GgmlQuantizedMatmulIdParams GgmlQuantizedMatmulIdRoute
    GgmlQuantizedMatmulIdRoutePlan GgmlQuantizedMatmulIdShape GgmlQuantizedMatmulParams
    GgmlQuantizedMatmulReceipt GgmlRejectionCode GgmlRoutingPolicy GgmlTensorMmPreference
    GgmlType GgmlWorkload GraphExec GraphSession InvalidArgumentError InvalidArgumentTypeError
    KernelNotFoundError KernelRegistry MOE_PIPELINE_NAMES MissingDependencyError MoeLayer
    OutOfMemoryError Pipeline PipelineIdentity Q4_MATMUL_PIPELINE_NAMES
    Q8_0_MAT_VEC_NR2_PIPELINE Q8_MATMUL_PIPELINE_NAMES
    QUANTIZED_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM UnsupportedError available_backends
    backend_status calibrate_dense_matmul_id_routes calibrate_dense_q4_routes
    calibrate_quantized_matmul_id_routes calibration core dense_matmul_id dense_matmul_id_auto
    dense_matmul_id_capability dense_matmul_id_expected_dispatches dense_matmul_id_plan
    dense_q4_auto dense_q4_plan dequantize dispatch_count dtype_of encode_moe_combine encode_moe_gate
    encode_moe_silu_mul encode_q4_route encoder_counters env formats freeze_dense_matmul_id_plan
    freeze_dense_matmul_id_plan_for_cases freeze_dense_q4_plan freeze_ggml_routing_policy
    freeze_quantized_matmul_id_plan from_dlpack ggml_capability ggml_routes ggml_routing_policy
    gguf_io gguf_metadata gguf_tensor load_dense_matmul_id_plan load_dense_q4_plan
    load_quantized_matmul_id_plan logger matmul_id models moe moe_experts moe_gate moe_layer
    numpy_dtype ops plan_dense_auto_route plans q4_0 q4_expected_dispatch q8_0 quantize quantized_matmul
    quantized_matmul_ggml quantized_matmul_id quantized_matmul_id_ggml
    quantized_matmul_id_ggml_auto quantized_matmul_id_ggml_capability quantized_matmul_id_plan
    reset_encoder_counters resolve_dense_matmul_id_auto_route
    resolve_quantized_matmul_id_auto_route schemas select_dense_q4_route trace_dense_matmul_id
    trace_dense_matmul_id_auto trace_dense_q4_auto validate_dense_q4_cartesian_acceptance
""".split()

# Module paths the docs and README name, and the layer module each one is.
MODULE_PATHS = {
    "routemm.torch": "routemm.integrations.torch",
    "routemm.q4_0": "routemm.formats.q4_0",
    "routemm.q8_0": "routemm.formats.q8_0",
    "routemm.env": "routemm.core.env",
    "routemm.schemas": "routemm.core.schemas",
    "routemm.calibration": "routemm.plans.calibration",
    "routemm.dense_matmul_id": "routemm.ops.dense_matmul_id",
    "routemm.integrations.transformers": "routemm.integrations.transformers",
}


def test_the_public_names_of_routemm_are_pinned():
    code = "import routemm; print(sorted(n for n in dir(routemm) if not n.startswith('_')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip() == str(PUBLIC_NAMES)


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_every_public_name_imports(name):
    exec(f"from routemm import {name}", {})


def test_the_names_of___all___are_public_names():
    assert sorted(set(routemm.__all__)) == sorted(routemm.__all__)
    assert set(routemm.__all__) <= set(PUBLIC_NAMES)


@pytest.mark.parametrize("path", sorted(MODULE_PATHS))
def test_documented_module_paths_import_as_their_layer_module(path):
    if path in ("routemm.torch", "routemm.integrations.transformers"):
        pytest.importorskip("torch")
    assert importlib.import_module(path) is importlib.import_module(MODULE_PATHS[path])


def test_the_function_dense_matmul_id_keeps_its_name_beside_the_module_path():
    from routemm.dense_matmul_id import auto_grouped

    assert auto_grouped is routemm.ops.dense_matmul_id.auto_grouped
    assert callable(routemm.dense_matmul_id) and routemm.dense_matmul_id.__name__ == "dense_matmul_id"
    assert routemm.matmul_id is routemm.ops.matmul_id.matmul_id


def test_python_m_routemm_runs_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "routemm", "help"], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.startswith("usage: python -m routemm")
