"""The one tolerance table of the Python suite (DESIGN.md style rule 7).

Every numeric check compares a kernel result with a float64 NumPy reference built from the
*exactly widened* weights: F16 and BF16 values (subnormals included) are all representable in
F32 and in float64, and the kernels widen them exactly before multiplying.  The only error left is
therefore F32 accumulation, which does not depend on the weight dtype -- so the table gives every
weight dtype the same entry.  The spec's looser table (§7.5: f32 2e-4, f16 3e-2, bf16 6e-2) is for
a reference that itself sums in F32; ``test_tolerance_table_is_tighter_than_spec`` pins that ours
never exceeds it.

Two checks, both applied where they make sense:

* ``TABLE``: abs + rel * |ref| for well-scaled random data (|w|, |x| <= 1); the abs term grows with
  sqrt(K / 32) (random-walk growth of rounding error) and with the data scale.
* ``accumulation_bound``: a rigorous, scale-free bound for any data (edge values, huge/tiny
  magnitudes): each of the kernel's F32 fused multiply-adds and lane additions rounds once, and a
  result computed through a chain of d roundings differs from the exact sum by at most
  gamma_d * sum|w*x| (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), plus at most
  2^-150 per operation where results are subnormal.
"""

from __future__ import annotations

import math

import numpy as np
from routemm import DType

U = 2.0**-24  # unit roundoff of F32
SUBNORMAL_HALF_ULP = 2.0**-150

# Spec §7.5 table (against an F32-summed reference); informational upper limit for TABLE.
SPEC_TOLERANCES = {DType.F32: 2e-4, DType.F16: 3e-2, DType.BF16: 6e-2}

# (abs, rel) per weight dtype against the exactly-widened float64 reference.
TABLE = {
    DType.F32: (2e-4, 2e-4),
    DType.F16: (2e-4, 2e-4),
    DType.BF16: (2e-4, 2e-4),
}


def table_tolerance(dtype: DType, k: int, scale: float = 1.0) -> tuple[float, float]:
    """(atol, rtol) for random data with |w| * |x| <= scale."""
    atol, rtol = TABLE[dtype]
    return atol * max(1.0, math.sqrt(k / 32.0)) * scale, rtol


def accumulation_bound(k: int, magnitude: np.ndarray) -> np.ndarray:
    """Rigorous bound on |F32 result - exact| given magnitude = sum_i |w_i * x_i| (float64).

    Depth: ceil(K/8) chained FMAs per lane (the CPU contract uses 8 lanes; Metal/CUDA lanes are at
    least as many, so their chains are no longer) plus a reduction tree of at most log2(32) = 5
    additions; one extra for slack.
    """
    depth = math.ceil(k / 8) + 6
    gamma = depth * U / (1 - depth * U)
    return gamma * magnitude + (k + 8) * SUBNORMAL_HALF_ULP


def assert_close(
    got: np.ndarray,
    ref: np.ndarray,
    magnitude: np.ndarray,
    *,
    dtype: DType,
    k: int,
    use_table: bool = True,
    scale: float = 1.0,
    context: str = "",
) -> None:
    """got (F32) against ref (float64): the rigorous bound always, the table for random data."""
    got64 = got.astype(np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got64)), f"{context}: non-finite values where the reference is finite"
    err = np.abs(got64 - ref)
    bound = accumulation_bound(k, magnitude)
    bad = err > bound
    assert not bad.any(), (
        f"{context}: {int(bad.sum())} element(s) beyond the F32 accumulation bound; worst "
        f"err {err[bad].max():.3e} at {np.argwhere(bad)[0].tolist()}"
    )
    if use_table:
        atol, rtol = table_tolerance(dtype, k, scale)
        np.testing.assert_allclose(got64, ref, atol=atol, rtol=rtol, err_msg=context)


# Tensor-core routes: relative Frobenius error ||out - ref|| / ||ref|| against the float64
# reference of the exactly widened weights (operands are rounded, so per-element tables do not fit).
# quantized_matmul_id_ggml's grouped_tensor_lowp has lowp's entry: its weights enter exactly (block
# integers in f16, the scale applied in F32), so its only operand rounding is the activations' to
# f16, as for f16 weights on the dense route.
from routemm import DenseMatmulIdRoute as _Route  # noqa: E402
from routemm import GgmlQuantizedMatmulIdRoute as _QRoute  # noqa: E402

TENSOR_ROUTE_FROBENIUS = {
    _Route.GROUPED_TENSOR_TF32: 2e-3,
    _Route.GROUPED_TENSOR_LOWP: 1e-2,
    _QRoute.GROUPED_TENSOR_LOWP: 1e-2,
}

# The CPU bf16-dot routes (direct_bf16_dot, grouped_bf16_dot; bf16 weights): activations rounded
# to bf16 (2^-9 relative), exact bf16 products summed in F32 by VDPBF16PS (kp / 32 + 4 roundings
# per lane), subnormal inputs and results flushed to zero. Per element, against the float64
# product of the stored weights and the F32 activations:
#   |err| <= 2^-8 * sum_i |w_i * x_i| + k * 2^-126,
# and, for random data, relative Frobenius error within 1e-2 (as grouped_tensor_lowp).
BF16_DOT_FROBENIUS = 1e-2


def bf16_dot_bound(k: int, magnitude: np.ndarray) -> np.ndarray:
    """Bound on |result - exact| of a bf16-dot route (magnitude = sum |w * x|, float64)."""
    return 2.0**-8 * magnitude + k * 2.0**-126


# The CPU int8-dot routes (GgmlRoutingPolicy.dense_int8_dot; Q4_0 / Q8_0 weights): each 32-value
# activation block rounded to int8 with the binary32 scale d = max|x| / 127 (|x - d q| <= d (1/2 +
# 2^-15)), exact integer block dot products, then one chain of K / 32 F32 FMAs per output, each
# with the product of the two scales (one more rounding; contract in
# csrc/backend/cpu/ggml_int8_dot.h). Per element, against the float64 product of the exactly
# dequantised weights and the F32 activations:
#   |err| <= sum_i |w_i| d_i (1/2 + 2^-15) + gamma(K/32 + 1) sum_i |w_i| (|x_i| + d_i)
#            + 2^-100 sum_i |w_i|    (blocks with max|x| < 2^-100 round to zero)
# and, for random data, relative Frobenius error within 2e-2.
INT8_DOT_FROBENIUS = 2e-2


def int8_dot_scales(x: np.ndarray) -> np.ndarray:
    """Each activation's block scale d (float64 array shaped like x), as the int8-dot routes
    compute it: max |x| of its 32-value block over 127, rounded to binary32; 0 below 2^-100."""
    x = np.asarray(x, np.float32)
    blocks = np.abs(x).reshape(*x.shape[:-1], -1, 32).max(axis=-1)
    d = (blocks / np.float32(127)).astype(np.float32).astype(np.float64)
    d[blocks < np.float32(2.0**-100)] = 0.0
    return np.repeat(d, 32, axis=-1)


def int8_dot_bound(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bound on |result - exact| of an int8-dot route, [m, n], for dequantised weights [n, k]
    (float64) and F32 activations [m, k]."""
    w = np.abs(np.asarray(weights, np.float64))
    ax = np.abs(np.asarray(x, np.float64))
    d = int8_dot_scales(x)
    steps = x.shape[-1] // 32 + 1
    gamma = steps * 2.0**-24 / (1 - steps * 2.0**-24)
    rounding = (d * (0.5 + 2.0**-15)) @ w.T
    accumulation = gamma * ((ax + d) @ w.T)
    return rounding + accumulation + 2.0**-100 * w.sum(axis=1)[None, :]


# The K-quant int8-dot routes (Q4_K, Q5_K, Q6_K; contract in csrc/backend/cpu/ggml_kquant_int8_dot.h):
# each 256-value activation block rounded to int8 with d = max|x| / 127, exact integer sums per
# super-block (S over the scaled codes, M over the mins), then per super-block one or two F32 FMAs
# with the products of the scales. W_i = |d_w| sc u_i + |dmin| m (Q4_K, Q5_K) or |w_i| (Q6_K) is
# what the integer sums carry:
#   |err| <= sum_i |w_i| d_i (1/2 + 2^-15) + gamma(2 K/256 + 3) sum_i W_i (|x_i| + d_i)
#            + 2^-100 sum_i |w_i|
# and, for heavy-tailed random data, relative Frobenius error within 5e-2 (one scale per 256 values:
# an outlier coarsens eight times as many activations as in a 32-value block).
KQUANT_INT8_DOT_BLOCK = 256
KQUANT_INT8_DOT_FROBENIUS = 5e-2


def kquant_int8_dot_magnitudes(blocks: np.ndarray, ggml_type, n: int, k: int) -> np.ndarray:
    """W [n, k] of a K-quant matrix's blocks: the dequantised values with the min term taken apart.
    The codes zeroed, the dequantiser gives -dmin m per value; |w + dmin m| + |dmin m| is then
    d_w sc u + dmin m in magnitude (Q6_K has no min: |w|)."""
    from routemm.formats import ggml

    name = getattr(ggml_type, "value", ggml_type)
    w = ggml.dequantize(blocks, name).reshape(n, k).astype(np.float64)
    if name == "q6_k":
        return np.abs(w)
    raw = np.array(blocks, np.uint8).reshape(n, k // 256, -1).copy()
    raw[:, :, 16:] = 0  # Q4_K qs, Q5_K qh and qs: every code 0
    mins = -ggml.dequantize(raw.reshape(n, -1), name).reshape(n, k).astype(np.float64)
    return np.abs(w + mins) + np.abs(mins)


def kquant_int8_dot_bound(weights: np.ndarray, magnitudes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bound on |result - exact| of a K-quant int8-dot route, [m, n], for dequantised weights [n, k]
    (float64), their magnitudes W (kquant_int8_dot_magnitudes) and F32 activations [m, k]."""
    x = np.asarray(x, np.float32)
    w = np.abs(np.asarray(weights, np.float64))
    blocks = np.abs(x).reshape(*x.shape[:-1], -1, KQUANT_INT8_DOT_BLOCK).max(axis=-1)
    d = (blocks / np.float32(127)).astype(np.float32).astype(np.float64)
    d[blocks < np.float32(2.0**-100)] = 0.0
    d = np.repeat(d, KQUANT_INT8_DOT_BLOCK, axis=-1)
    steps = 2 * (x.shape[-1] // KQUANT_INT8_DOT_BLOCK) + 3
    gamma = steps * 2.0**-24 / (1 - steps * 2.0**-24)
    rounding = (d * (0.5 + 2.0**-15)) @ w.T
    accumulation = gamma * ((np.abs(x.astype(np.float64)) + d) @ np.asarray(magnitudes, np.float64).T)
    return rounding + accumulation + 2.0**-100 * w.sum(axis=1)[None, :]


# ---- GGML Q4_0 dense projections (quantized_matmul_ggml) -----------------------------------------
#
# Reference: float64 over the *exactly* dequantised weights (d * (nibble - 8) is exact in F32 and
# float64), so, as above, only F32 accumulation error is left. On the CPU every route (mat-vec and
# the four matrix routes) follows one contract -- eight FMA lanes over K, then the fixed lane tree
# (csrc/backend/cpu/q4_matmul.cpp) -- so `accumulation_bound` holds for each of them and they agree
# bit for bit. The table states, per route, the (abs, rel) allowed for random data with |w|, |x| <=
# ~1 (abs grows with sqrt(K / 32) through `q4_tolerance`).
#
# CUDA routes run on tensor cores with the numerics stated in csrc/backend/cuda/q4_matmul.cu, so they
# are checked against their own scale-free bounds (`q4_gpu_bound`) instead of the F32 FMA chain:
# * split (mat-vec, simdgroup, V1): exact weights, x = hi + lo in bf16 (|x - hi - lo| <= 2^-18 |x|),
#   each 32-value block summed by the tensor cores (F32, truncating alignment) then one FMA per block:
#   |err| <= (2^-14 + (K / 32 + 8) * 2^-23) * sum|w x|.
# * bf16 (V2, 64x32): weights bf16(bf16(d) * (q - 8)), activations bf16(x), F32 accumulation:
#   |err| <= 2^-7 * sum|w x| (two weight roundings and one activation rounding of 2^-9 each, plus
#   accumulation), and relative Frobenius error within 1e-2.
Q4_ROUTE_TABLE = {
    "mat_vec": (2e-4, 2e-4),
    "compatibility_simdgroup": (2e-4, 2e-4),
    "compatibility_tensor_v1": (2e-4, 2e-4),
    "compatibility_v2": (2e-4, 2e-4),
    "tensor_64x32": (2e-4, 2e-4),
}


def q4_tolerance(route: str, k: int, scale: float = 1.0) -> tuple[float, float]:
    """(atol, rtol) of a Q4_0 route for random data with |w| * |x| <= scale."""
    atol, rtol = Q4_ROUTE_TABLE[route]
    return atol * max(1.0, math.sqrt(k / 32.0)) * scale, rtol


Q4_CUDA_NUMERICS = {
    "mat_vec": "split",
    "compatibility_simdgroup": "split",
    "compatibility_tensor_v1": "split",
    "compatibility_v2": "bf16",
    "tensor_64x32": "bf16",
}
Q4_CUDA_BF16_FROBENIUS = 1e-2


def q4_gpu_bound(route: str, k: int, magnitude: np.ndarray) -> np.ndarray:
    """Scale-free bound on |result - exact| for a CUDA Q4_0 route (magnitude = sum |w * x|)."""
    if Q4_CUDA_NUMERICS[route] == "split":
        rel = 2.0**-14 + (k / 32 + 8) * 2.0**-23
    else:
        rel = 2.0**-7
    return rel * magnitude + (k + 8) * SUBNORMAL_HALF_ULP


def q4_cuda_default_bound(m: int, k: int, magnitude: np.ndarray) -> np.ndarray:
    """q4_gpu_bound of the route CUDA's default policy gives m tokens: the split-numerics mat-vec
    up to 8 tokens, a bf16 matrix route above (compatibility_v2 and tensor_64x32 share a bound)."""
    return q4_gpu_bound("mat_vec" if m <= 8 else "compatibility_v2", k, magnitude)


# ---- The MoE layer (moe_gate, moe_experts, MoeLayer) ----------------------------------------------
#
# Gate weights: one F32 exp per expert (the backend's, a few ulps) and an F32 sum over E terms, so
# (abs, rel) = (1e-6, 1e-5) for the probabilities; ids compare exactly (random logits have no ties).
# Experts and whole layers: two chained F32 matmul contracts (K = H, then K = I) against the float64
# reference of the exactly widened / dequantised weights, with |w| ~ 1/sqrt(K) and |x| ~ N(0, 1):
# (abs, rel) = (2e-5, 2e-5). Backends differ only in exp() inside SiLU, far below that.
MOE_GATE_TOLERANCE = (1e-6, 1e-5)
MOE_EXPERTS_TOLERANCE = (2e-5, 2e-5)
