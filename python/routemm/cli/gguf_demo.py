"""`python -m routemm demo --gguf FILE [--layer N]`: one MoE layer of a real GGUF model, checked.

Loads the layer's router and expert stacks from the file (zero copy on the CPU backend), runs
router + gate + experts on random hidden states (decode and prefill), and compares each output with
a float64 reference computed from the same weights (quantised blocks dequantised exactly). A token
whose float64 router logits tie within ROUTING_TIE at the top-k boundary may route differently in
F32; it is reported and left out of the error, never silently.
"""

from __future__ import annotations

import time

import numpy as np

from .. import _core
from ..models.moe_layer import MoeLayer

# Relative error (against max |reference|) a layer output may have: two chained F32 matmuls.
MAX_REL_ERROR = 1e-4
# Gap between the k-th and (k+1)-th float64 router logits below which F32 may rank them otherwise.
ROUTING_TIE = 1e-4


def run(path, layer: int, tokens: int, backend, seed: int) -> dict:
    device = _core.Device(backend)
    started = time.perf_counter()
    moe = MoeLayer.from_gguf(path, layer, device=device)
    load_s = time.perf_counter() - started
    weights = moe.float_weights()
    rng = np.random.default_rng(seed)
    report = {
        "file": str(path),
        "layer": layer,
        "backend": device.backend,
        "device": device.name,
        "n_experts": moe.n_experts,
        "top_k": moe.top_k,
        "hidden": moe.hidden,
        "intermediate": moe.intermediate,
        "renormalize": moe.renormalize,
        "expert_type": moe.ggml_type.value if moe.ggml_type is not None else moe.gate.dtype.name.lower(),
        "load_s": load_s,
        "runs": [],
    }
    for m in (1, tokens):
        hidden = rng.standard_normal((m, moe.hidden)).astype(np.float32)
        moe(hidden)  # warm-up
        started = time.perf_counter()
        out = moe(hidden)
        seconds = time.perf_counter() - started
        ref, ref_ids, logits = moe.reference(hidden, weights)
        ranked = np.sort(logits, axis=1)[:, ::-1]
        gap = ranked[:, moe.top_k - 1] - ranked[:, moe.top_k] if moe.top_k < moe.n_experts else np.full(m, np.inf)
        tied = gap < ROUTING_TIE * np.maximum(1.0, np.abs(ranked[:, 0]))
        keep = ~tied
        scale = float(np.max(np.abs(ref[keep]))) if keep.any() else 1.0
        err = float(np.max(np.abs(out[keep] - ref[keep]))) / (scale or 1.0) if keep.any() else 0.0
        report["runs"].append(
            {
                "m": m,
                "time_us": seconds * 1e6,
                "max_rel_error": err,
                "tied_tokens": int(tied.sum()),
                "all_finite": bool(np.all(np.isfinite(out))),
            }
        )
    report["ok"] = all(r["all_finite"] and r["max_rel_error"] < MAX_REL_ERROR for r in report["runs"])
    return report


def print_report(report: dict) -> None:
    print(
        f"routemm demo: {report['file']} layer {report['layer']} (E={report['n_experts']}, "
        f"top_k={report['top_k']}, H={report['hidden']}, I={report['intermediate']}, "
        f"{report['expert_type']} experts, renormalize={report['renormalize']}) on {report['backend']} "
        f"({report['device']}); loaded in {report['load_s']:.2f} s"
    )
    print(f"{'m':>6} {'time_us':>12} {'max rel err':>12} {'tied tokens':>12}")
    for r in report["runs"]:
        print(f"{r['m']:>6} {r['time_us']:>12.1f} {r['max_rel_error']:>12.2e} {r['tied_tokens']:>12}")
    print("OK" if report["ok"] else "FAILED: the layer differs from the float64 reference")
