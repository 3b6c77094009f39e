"""`python -m routemm demo --gguf FILE [--layer N]`: every MoE layer of a GGUF model, checked.

Finds the file's MoE layers (routemm.gguf_io.gguf_moe_layers: those with a router; `--layer N` runs
that one alone), and for each loads the router and experts (zero copy on the CPU backend), runs
router + gate + experts on random hidden states (decode and prefill) and compares each output with
a float64 reference computed from the same weights (quantised blocks dequantised exactly). A token
whose float64 router logits tie within ROUTING_TIE at the top-k boundary may route differently in
F32; it is reported and left out of the error, never silently. A layer routemm does not compute
(MoeLayer.from_gguf's UnsupportedError) is reported with the refusal and fails the run. Progress
goes to stderr, one bar over the layers; the table to stdout.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .. import _core
from ..core._errors import UnsupportedError
from ..formats.gguf_io import gguf_moe_layers
from ..models.moe_layer import MoeLayer
from .demo import cpu_clone

# Relative error (against max |reference|) a layer output may have: two chained F32 matmuls.
MAX_REL_ERROR = 1e-4
# Gap between the k-th and (k+1)-th float64 router logits below which F32 may rank them otherwise.
ROUTING_TIE = 1e-4
_BAR_WIDTH = 30


def _progress(done: int, total: int, label: str, stream) -> None:
    """One line of progress on `stream`, redrawn in place: [#####.....] done/total label."""
    filled = _BAR_WIDTH * done // max(total, 1)
    stream.write(f"\r[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done}/{total} {label:<24}")
    if done == total:
        stream.write("\n")
    stream.flush()


def _type_name(moe: MoeLayer) -> str:
    kind = moe.ggml_type
    if kind is None:
        return moe.gate.dtype.name.lower()
    return "/".join(t.value for t in kind) if isinstance(kind, tuple) else kind.value


def run_layer(path, layer: int, tokens: int, device, rng) -> dict:
    """One layer's entry of the report: its shape and type, load time, and per run (m = 1 and
    `tokens`) the time and the error against float64; a refused layer has "refused" instead."""
    started = time.perf_counter()
    try:
        moe = MoeLayer.from_gguf(path, layer, device=device)
    except UnsupportedError as e:
        return {"layer": layer, "refused": str(e), "ok": False}
    entry = {
        "layer": layer,
        "n_experts": moe.n_experts,
        "top_k": moe.top_k,
        "hidden": moe.hidden,
        "intermediate": moe.intermediate,
        "renormalize": moe.renormalize,
        "expert_type": _type_name(moe),
        "load_s": time.perf_counter() - started,
        "runs": [],
    }
    weights = moe.float_weights()
    for m in (1, tokens):
        hidden = rng.standard_normal((m, moe.hidden)).astype(np.float32)
        moe(hidden)  # warm-up
        started = time.perf_counter()
        out = moe(hidden)
        seconds = time.perf_counter() - started
        ref, _, logits = moe.reference(hidden, weights)
        ranked = np.sort(logits, axis=1)[:, ::-1]
        gap = ranked[:, moe.top_k - 1] - ranked[:, moe.top_k] if moe.top_k < moe.n_experts else np.full(m, np.inf)
        tied = gap < ROUTING_TIE * np.maximum(1.0, np.abs(ranked[:, 0]))
        keep = ~tied
        scale = float(np.max(np.abs(ref[keep]))) if keep.any() else 1.0
        err = float(np.max(np.abs(out[keep] - ref[keep]))) / (scale or 1.0) if keep.any() else 0.0
        entry["runs"].append(
            {
                "m": m,
                "time_us": seconds * 1e6,
                "max_rel_error": err,
                "tied_tokens": int(tied.sum()),
                "all_finite": bool(np.all(np.isfinite(out))),
            }
        )
    entry["ok"] = all(r["all_finite"] and r["max_rel_error"] < MAX_REL_ERROR for r in entry["runs"])
    return entry


def run(path, layer, tokens: int, backend, seed: int, *, progress=None) -> dict:
    """The report over `layer` (an index) or, with None, every MoE layer of the file; `progress`: a
    stream for the progress bar (default stderr)."""
    device = _core.Device(backend)
    layers = [layer] if layer is not None else gguf_moe_layers(path)
    stream = sys.stderr if progress is None else progress
    rng = np.random.default_rng(seed)
    report = {
        "file": str(path),
        "backend": device.backend,
        "device": device.name,
        "cpu_isa": cpu_clone(device),
        "layers": [],
    }
    started = time.perf_counter()
    for done, n in enumerate(layers):
        _progress(done, len(layers), f"layer {n}", stream)
        report["layers"].append(run_layer(path, n, tokens, device, rng))
    _progress(len(layers), len(layers), "done", stream)
    report["elapsed_s"] = time.perf_counter() - started
    report["ok"] = bool(layers) and all(entry["ok"] for entry in report["layers"])
    return report


def print_report(report: dict) -> None:
    layers = report["layers"]
    clone = f", {report['cpu_isa']} kernels" if report.get("cpu_isa") else ""
    print(
        f"routemm demo: {report['file']}, {len(layers)} MoE layers on {report['backend']} ({report['device']}{clone})"
    )
    print(f"{'layer':>5} {'m':>6} {'time_us':>12} {'max rel err':>12} {'tied tokens':>12}")
    for entry in layers:
        if "refused" in entry:
            print(f"{entry['layer']:>5} refused: {entry['refused']}")
            continue
        print(
            f"layer {entry['layer']} (E={entry['n_experts']}, top_k={entry['top_k']}, H={entry['hidden']}, "
            f"I={entry['intermediate']}, {entry['expert_type']} experts, renormalize={entry['renormalize']}); "
            f"loaded in {entry['load_s']:.2f} s"
        )
        for r in entry["runs"]:
            print(
                f"{entry['layer']:>5} {r['m']:>6} {r['time_us']:>12.1f} {r['max_rel_error']:>12.2e} "
                f"{r['tied_tokens']:>12}"
            )
    if not layers:
        print("FAILED: the file has no MoE layer (no blk.N.ffn_gate_inp.weight)")
    elif report["ok"]:
        print("OK")
    else:
        bad = [str(e["layer"]) for e in layers if not e["ok"]]
        print(f"FAILED: layers {', '.join(bad)} were refused or differ from the float64 reference")
