"""Environment knobs: one table (name, type, default, effect).

Native knobs are read once by the core at first use; Python knobs are read at import. Receipts
record every knob set to a non-default value (`non_default()`).
"""

from __future__ import annotations

import dataclasses
import os

from .. import _core


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    type: str
    default: str
    effect: str


_PYTHON_KNOBS = (
    Knob("ROUTEMM_LOG_LEVEL", "str", "", "level of the 'routemm' logger (DEBUG, INFO, ...); unset leaves it alone"),
    Knob(
        "ROUTEMM_PLAN_CACHE_DIR",
        "path",
        "",
        "directory where calibrated route plans are saved and reloaded automatically (unset: no plan files)",
    ),
    Knob(
        "ROUTEMM_METALLIB_PATH",
        "path",
        "",
        "routemm.metallib the Metal backend loads instead of the one installed beside the extension (macOS)",
    ),
    Knob(
        "ROUTEMM_TORCH_KERNELS",
        "str",
        "auto",
        "kernels of torch.ops.routemm.* (read when routemm.torch is imported): auto takes the C++ kernels where built for the running torch, python forces the Python kernels, cpp makes their absence an ImportError",
    ),
    Knob(
        "ROUTEMM_TEST_BACKENDS",
        "str",
        "",
        "test suite only: comma-separated backends to test (default: every available one)",
    ),
    Knob(
        "ROUTEMM_DISABLE_TENSOR_MM",
        "bool",
        "0",
        "1: Q4_0 matrix routes use the compatibility simdgroup kernel (read by GgmlRoutingPolicy.from_environment())",
    ),
    Knob(
        "ROUTEMM_LARGE_TILE_MM",
        "bool",
        "1",
        "0/false/off: Q4_0 matrix routes may not use the large-tile V2 kernel or the 64x32 candidate (read by GgmlRoutingPolicy.from_environment())",
    ),
    Knob(
        "ROUTEMM_DECODE_MVN",
        "bool",
        "1",
        "0/false/off: GgmlRoutingPolicy.dense_decode_mvn (K-quant width-mN tiles; recorded only)",
    ),
    Knob(
        "ROUTEMM_DECODE_MV_EXT",
        "bool",
        "0",
        "1/true/on: GgmlRoutingPolicy.dense_decode_mv_ext (mul_mv_ext; recorded only)",
    ),
    Knob(
        "ROUTEMM_Q6K_MV_NR2",
        "bool",
        "1",
        "0/false/off: GgmlRoutingPolicy.dense_q6k_mv_nr2 (recorded only)",
    ),
    Knob(
        "ROUTEMM_Q8_0_MV_NR2",
        "bool",
        "1",
        "0/false/off: GgmlRoutingPolicy.dense_q8_0_mv_nr2 (Q8_0 mat-vec without the nr2 kernel)",
    ),
    Knob(
        "ROUTEMM_DENSE_INT8_DOT",
        "bool",
        "0",
        "1/true/on: GgmlRoutingPolicy.dense_int8_dot (Q4_0/Q8_0/Q4_K/Q5_K/Q6_K projections round activations to int8: reduced precision, CPU)",
    ),
    Knob(
        "ROUTEMM_MM_ID_ROUTING_THRESHOLD",
        "int",
        "8",
        "GgmlRoutingPolicy.expert_mm_threshold: the automatic expert-ID route groups only calls of more than this many tokens (tensor and torch ops and the MoE op: read once, at first use)",
    ),
    Knob(
        "ROUTEMM_Q6K_ID_MV_NR2",
        "bool",
        "1",
        "0/false/off: GgmlRoutingPolicy.expert_q6k_mv_nr2 (recorded only)",
    ),
    Knob(
        "ROUTEMM_Q8_0_ID_MV_NR2",
        "bool",
        "0",
        "1/true/on: GgmlRoutingPolicy.expert_q8_0_mv_nr2: Q8_0 expert-ID direct calls run the nr2 pipeline where the backend has it (CPU, Metal; tensor and torch ops and the MoE op: read once, at first use)",
    ),
    Knob(
        "ROUTEMM_DISABLE_TENSOR_MM_ID",
        "bool",
        "0",
        "1: GgmlRoutingPolicy.expert_tensor_mm = force_simd: the automatic expert-ID choices keep off tensor-core kernels (the MoE op's automatic route, read once at first use; the expert-ID calibrations)",
    ),
)

KNOBS: tuple[Knob, ...] = tuple(Knob(*row) for row in _core.env_knobs()) + _PYTHON_KNOBS


def non_default() -> dict[str, str]:
    """Knobs whose value differs from the default, as receipts record them."""
    out = dict(_core.env_non_default())
    for knob in _PYTHON_KNOBS:
        value = os.environ.get(knob.name, "")
        if value and value != knob.default and knob.name != "ROUTEMM_TEST_BACKENDS":
            out[knob.name] = value
    return out


def table_markdown() -> str:
    """The knob table as Markdown (the README's table is generated from this)."""
    lines = ["| name | type | default | effect |", "|---|---|---|---|"]
    for k in KNOBS:
        lines.append(f"| `{k.name}` | {k.type} | {k.default or '(unset)'} | {k.effect} |")
    return "\n".join(lines)
