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
