"""The Metal shaders (metal/*.metal) define a kernel for every pipeline name the package exports.

Runs everywhere (it reads source text only): the Metal backend is built and tested on macOS, and
this keeps a renamed or missing kernel from going unnoticed on every other host. The C++ side of
the same contract (csrc/backend/metal/kernels.cpp against the core tables, bindings, geometry) is
tests/metal/test_metal_kernel_table.cpp.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import routemm
from routemm.calibration import COMPARE_PIPELINE, POISON_PIPELINE

SHADER_DIR = Path(__file__).resolve().parents[2] / "metal"
PIPELINES = [
    *routemm.DENSE_MATMUL_ID_PIPELINE_NAMES,
    *routemm.Q4_MATMUL_PIPELINE_NAMES,
    *routemm.Q8_MATMUL_PIPELINE_NAMES,
    routemm.Q8_0_MAT_VEC_NR2_PIPELINE,
    routemm.GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE,
    *routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES,
    *routemm.MOE_PIPELINE_NAMES,
    POISON_PIPELINE,
    COMPARE_PIPELINE,
    # The four pipelines of each format beyond Q4_0 / Q8_0 (routemm/ggml_formats.h).
    *(name for f in routemm._core.GGML_KERNEL_FORMATS for name in f[4:]),
]
TENSOR_ONLY = {
    "kernel_mul_mm_q4_0_tensor_f32",
    "kernel_mul_mm_q4_0_tensor_v2_f32",
    "kernel_mul_mm_q4_0_tensor_64x32_f32",
}


def _kernels() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted(SHADER_DIR.glob("*.metal")):
        for name in re.findall(r"\bkernel\s+void\s+(\w+)\s*\(", path.read_text()):
            assert name not in found, f"kernel {name} defined in {found[name]} and {path.name}"
            found[name] = path.name
    return found


if not SHADER_DIR.is_dir():  # an installed package without the source tree
    pytest.skip("metal/ sources not present", allow_module_level=True)


@pytest.mark.parametrize("name", PIPELINES)
def test_every_pipeline_has_a_metal_kernel(name):
    kernels = _kernels()
    assert name in kernels, f"no `kernel void {name}(` in metal/*.metal"
    # The tensor-API routes live in their own, optional library.
    assert (kernels[name] == "q4_matmul_tensor.metal") == (name in TENSOR_ONLY)


def test_no_unregistered_metal_kernels():
    assert set(_kernels()) <= set(PIPELINES)
