"""Float64 NumPy reference of the expert-ID matmul (the oracle for tests, the demo and benchmarks)."""

from __future__ import annotations

import numpy as np


def dense_matmul_id_reference(weights: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """out[t*top_k + s] = W[ids[t, s]] @ row, in float64; ids outside [0, E) give zero rows.

    weights [E, n, k] (any float dtype, widened exactly), x [m, k] or [m, top_k, k], ids [m, top_k].
    Works expert by expert so full model sizes fit in memory.
    """
    n_experts, n, _ = weights.shape
    m, top_k = ids.shape
    rows = x.reshape(m, -1, x.shape[-1]).astype(np.float64)
    slotted = rows.shape[1] == top_k and x.ndim == 3
    out = np.zeros((m * top_k, n), dtype=np.float64)
    flat_ids = ids.reshape(-1).astype(np.int64)
    for e in np.unique(flat_ids):
        if e < 0 or e >= n_experts:
            continue
        flat = np.nonzero(flat_ids == e)[0]
        token, slot = flat // top_k, flat % top_k
        act = rows[token, slot if slotted else 0]
        out[flat] = act @ weights[e].astype(np.float64).T
    return out


def moe_gate_reference(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(weights float64 [m, top_k], ids int64 [m, top_k]) under moe_gate's contract, in float64.

    Ranking by logit, descending, ties to the lower index; NaN ranks as -inf; a row whose largest
    logit is +inf shares the mass among its +inf experts; a row with no logit above -inf has
    weights 0.
    """
    z = np.where(np.isnan(logits), -np.inf, logits.astype(np.float64))
    ids = np.argsort(-z, axis=1, kind="stable")[:, :top_k]
    top = np.take_along_axis(z, ids, axis=1)
    zmax = z.max(axis=1, keepdims=True)
    weights = np.zeros(ids.shape, dtype=np.float64)
    finite = np.isfinite(zmax[:, 0])
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(z[finite] - zmax[finite])
        weights[finite] = np.exp(top[finite] - zmax[finite]) / e.sum(axis=1, keepdims=True)
    plus_inf = zmax[:, 0] == np.inf
    count = np.sum(z[plus_inf] == np.inf, axis=1, keepdims=True)
    weights[plus_inf] = np.where(top[plus_inf] == np.inf, 1.0 / np.maximum(count, 1), 0.0)
    if renormalize:
        total = weights.sum(axis=1, keepdims=True)
        weights = np.where(total > 0, weights / np.where(total > 0, total, 1.0), weights)
    return weights, ids


def moe_experts_reference(hidden, ids, weights, gate, up, down) -> np.ndarray:
    """out[t] = sum_s weights[t, s] * down[e] @ (silu(gate[e] @ x) * up[e] @ x), e = ids[t, s], in
    float64; slots with ids outside [0, E) contribute nothing. gate/up [E, I, H], down [E, H, I]."""
    m, top_k = ids.shape
    x = hidden.reshape(m, -1).astype(np.float64)
    g = dense_matmul_id_reference(gate, x, ids)
    u = dense_matmul_id_reference(up, x, ids)
    act = g / (1.0 + np.exp(-g)) * u
    y = dense_matmul_id_reference(down, act.reshape(m, top_k, -1), ids).reshape(m, top_k, -1)
    valid = (ids >= 0) & (ids < down.shape[0])
    w = np.where(valid, weights.astype(np.float64), 0.0)
    return np.einsum("ts,tsh->th", w, y)
