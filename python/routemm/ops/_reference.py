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


def moe_gate_reference(
    logits: np.ndarray,
    top_k: int,
    renormalize: bool,
    *,
    scoring_func: str = "softmax",
    e_score_correction_bias=None,
    num_expert_group=None,
    topk_group=None,
    routed_scaling_factor: float = 1.0,
    router_bias=None,
) -> tuple[np.ndarray, np.ndarray]:
    """(weights float64 [m, top_k], ids int64 [m, top_k]) under moe_gate's contract, in float64.

    router_bias (gpt-oss) is added to the logits before anything else (every later step reads the
    biased logits).
    Scores: softmax (a row whose largest logit is +inf shares the mass among its +inf experts; a
    row with no logit above -inf has scores 0) or sigmoid; NaN counts as -inf. Selection by score
    + bias (by logit without a bias), ties to the lower index, within the topk_group best of
    num_expert_group contiguous groups (group score: the sum of its two largest selection scores);
    weights: the unbiased scores, renormalised, times routed_scaling_factor.
    """
    z = logits.astype(np.float64)
    if router_bias is not None:
        with np.errstate(invalid="ignore"):
            z = z + np.asarray(router_bias, dtype=np.float64)[None, :]
    z = np.where(np.isnan(z), -np.inf, z)
    m, n_experts = z.shape
    with np.errstate(invalid="ignore", over="ignore"):
        if scoring_func == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-z))
        else:
            zmax = z.max(axis=1, keepdims=True)
            scores = np.zeros_like(z)
            finite = np.isfinite(zmax[:, 0])
            e = np.exp(z[finite] - zmax[finite])
            scores[finite] = e / e.sum(axis=1, keepdims=True)
            plus_inf = zmax[:, 0] == np.inf
            count = np.sum(z[plus_inf] == np.inf, axis=1, keepdims=True)
            scores[plus_inf] = np.where(z[plus_inf] == np.inf, 1.0 / np.maximum(count, 1), 0.0)
        selection = scores
        if e_score_correction_bias is not None:
            selection = scores + np.asarray(e_score_correction_bias, dtype=np.float64)[None, :]
            selection = np.where(np.isnan(selection), -np.inf, selection)
    key = selection if e_score_correction_bias is not None else z
    masked = np.zeros(z.shape, dtype=bool)
    if num_expert_group:
        size = n_experts // num_expert_group
        grouped = np.sort(selection.reshape(m, num_expert_group, size), axis=2)[:, :, ::-1]
        with np.errstate(invalid="ignore"):
            group_scores = grouped[:, :, 0] + (grouped[:, :, 1] if size > 1 else 0.0)
        group_scores = np.where(np.isnan(group_scores), -np.inf, group_scores)
        kept = np.argsort(-group_scores, axis=1, kind="stable")[:, :topk_group]
        keep = np.zeros((m, num_expert_group), dtype=bool)
        np.put_along_axis(keep, kept, True, axis=1)
        masked = ~np.repeat(keep, size, axis=1)
    index = np.broadcast_to(np.arange(n_experts), z.shape)
    ids = np.stack([np.lexsort((index[t], -key[t], masked[t]))[:top_k] for t in range(m)])
    weights = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        total = weights.sum(axis=1, keepdims=True)
        weights = np.where(total > 0, weights / np.where(total > 0, total, 1.0), weights)
    return weights * routed_scaling_factor, ids


def moe_experts_reference(
    hidden,
    ids,
    weights,
    gate,
    up,
    down,
    *,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_bias=None,
    up_bias=None,
    down_bias=None,
    weights_before_ffn: bool = False,
) -> np.ndarray:
    """out[t] = sum_s weights[t, s] * down[e] @ (silu(gate[e] @ x) * up[e] @ x), e = ids[t, s], in
    float64; slots with ids outside [0, E) contribute nothing. gate/up [E, I, H], down [E, H, I].

    Options as routemm.moe_experts takes them: activation "swiglu_oai" (g = min(g, limit),
    u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1)); biases gate_bias/up_bias
    [E, I] and down_bias [E, H] added after their products; weights_before_ffn: the weight scales
    the expert's input and the slots are summed with weight 1."""
    m, top_k = ids.shape
    x = hidden.reshape(m, -1).astype(np.float64)
    n_experts = down.shape[0]
    valid = (ids >= 0) & (ids < n_experts)
    w = np.where(valid, weights.astype(np.float64), 0.0)
    if weights_before_ffn:
        xs = x[:, None, :] * w[:, :, None]  # [m, top_k, H]: each slot's scaled input
        g = dense_matmul_id_reference(gate, xs, ids)
        u = dense_matmul_id_reference(up, xs, ids)
    else:
        g = dense_matmul_id_reference(gate, x, ids)
        u = dense_matmul_id_reference(up, x, ids)
    safe = np.where(valid, ids, 0).reshape(-1)
    if gate_bias is not None:
        g = g + np.asarray(gate_bias, dtype=np.float64)[safe]
    if up_bias is not None:
        u = u + np.asarray(up_bias, dtype=np.float64)[safe]
    if activation == "swiglu_oai":
        g = np.minimum(g, swiglu_limit)
        u = np.clip(u, -swiglu_limit, swiglu_limit)
        act = g / (1.0 + np.exp(-swiglu_alpha * g)) * (u + 1.0)
    else:
        act = g / (1.0 + np.exp(-g)) * u
    y = dense_matmul_id_reference(down, act.reshape(m, top_k, -1), ids).reshape(m, top_k, -1)
    if down_bias is not None:
        y = y + np.asarray(down_bias, dtype=np.float64)[safe].reshape(m, top_k, -1)
    combine = np.where(valid, 1.0, 0.0) if weights_before_ffn else w
    return np.einsum("ts,tsh->th", combine, y)
