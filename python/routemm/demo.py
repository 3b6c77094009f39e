"""`python -m routemm demo`: a random MoE projection of a real model's shape, both routes, checked.

Picks the best backend, runs `direct` at decode (m=1) and both routes at prefill, compares every
output with a float64 NumPy reference, and reports receipts, achieved GB/s and GFLOP/s and the error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import ml_dtypes
import numpy as np

from . import _core, env
from ._core_api import DType
from ._reference import dense_matmul_id_reference
from .dense_matmul_id import (
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    DenseMatmulIdScratch,
    dense_matmul_id,
)

# (n_experts, top_k, n, k) of one expert projection.
MODELS = {
    "qwen3-30b-a3b": (128, 8, 768, 2048),
    "deepseek-v3": (256, 8, 2048, 7168),
    "mixtral-8x7b": (8, 2, 14336, 4096),
}
# The default: a Qwen3-30B-A3B layer reduced to run in seconds on two CPU cores.
REDUCED = ("qwen3-30b-a3b-reduced", (32, 8, 384, 1024))

_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def _random_case(rng, n_experts, top_k, n, k, m, dtype):
    weights = (rng.standard_normal((n_experts, n, k), dtype=np.float32) / np.sqrt(k)).astype(dtype)
    x = rng.standard_normal((m, k), dtype=np.float32)
    # Distinct experts per token, as a router's top-k gives.
    ids = np.argsort(rng.random((m, n_experts)), axis=1)[:, :top_k].astype(np.uint32)
    return weights, x, ids


def _run_route(device, registry, bufs, params, repeats):
    w_buf, x_buf, id_buf, out_buf = bufs
    scratch = (
        DenseMatmulIdScratch(device, params.n_experts, params.m)
        if params.route is DenseMatmulIdRoute.GROUPED_PREFILL
        else None
    )
    receipt = encoded = None
    times = []
    for i in range(repeats + 1):
        encoder = device.command_encoder()
        if i == 0:
            encoder.start_encoded_dispatch_receipt(2)
        receipt = dense_matmul_id(encoder, registry, w_buf, x_buf, id_buf, out_buf, scratch, params)
        if i == 0:
            encoded = encoder.take_encoded_dispatch_receipt()
        start, end = encoder.commit_wait_with_gpu_time()
        if i > 0:  # the first run is a warm-up
            times.append(end - start)
    return receipt, encoded, statistics.median(times)


def run(model: str | None, m_prefill: int, dtype_name: str, backend: str | None, repeats: int, seed: int):
    name, (n_experts, top_k, n, k) = REDUCED if model is None else (model, MODELS[model])
    rng = np.random.default_rng(seed)
    device = _core.Device(backend)
    registry = _core.KernelRegistry(device)
    wdtype = _DTYPES[dtype_name]
    report = {
        "model": name,
        "backend": device.backend,
        "device": device.name,
        "shape": {"n_experts": n_experts, "top_k": top_k, "n": n, "k": k},
        "weight_dtype": dtype_name,
        "env": env.non_default(),
        "runs": [],
    }
    weights, _, _ = _random_case(rng, n_experts, top_k, n, k, 1, wdtype)
    w_buf = device.from_numpy(weights)
    for m, routes in (
        (1, [DenseMatmulIdRoute.DIRECT]),
        (m_prefill, [DenseMatmulIdRoute.DIRECT, DenseMatmulIdRoute.GROUPED_PREFILL]),
    ):
        _, x, ids = _random_case(rng, n_experts, top_k, n, k, m, wdtype)
        reference = dense_matmul_id_reference(weights, x, ids)
        x_buf, id_buf = device.from_numpy(x), device.from_numpy(ids)
        out_buf = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
        touched = len(np.unique(ids))
        nbytes = touched * n * k * np.dtype(wdtype).itemsize + x.nbytes + ids.nbytes + m * top_k * n * 4
        flops = 2 * m * top_k * n * k
        outputs = {}
        for route in routes:
            params = DenseMatmulIdParams(
                m,
                n,
                k,
                top_k,
                n_experts,
                n * k * np.dtype(wdtype).itemsize,
                DenseMatmulIdInputLayout.SHARED_PER_TOKEN,
                DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN,
                route,
            )
            out_buf.copy_from_numpy(np.full((m * top_k, n), np.nan, np.float32))
            receipt, encoded, seconds = _run_route(device, registry, (w_buf, x_buf, id_buf, out_buf), params, repeats)
            out = out_buf.numpy()
            outputs[route] = out
            scale = float(np.max(np.abs(reference))) or 1.0
            report["runs"].append(
                {
                    "m": m,
                    "route": route.value,
                    "time_us": seconds * 1e6,
                    "GBps": nbytes / seconds / 1e9,
                    "GFLOPs": flops / seconds / 1e9,
                    "experts_touched": touched,
                    "bytes": nbytes,
                    "flops": flops,
                    "max_abs_error": float(np.max(np.abs(out - reference))),
                    "max_rel_error": float(np.max(np.abs(out - reference)) / scale),
                    "all_written": bool(np.all(np.isfinite(out))),
                    "receipt": receipt.to_dict(),
                    "dispatches": [d.to_dict() for d in encoded],
                }
            )
        if len(outputs) == 2:
            a, b = outputs.values()
            report["routes_bit_identical_at_m%d" % m] = bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
    report["ok"] = all(r["all_written"] and r["max_rel_error"] < 1e-4 for r in report["runs"]) and all(
        v for key, v in report.items() if key.startswith("routes_bit_identical")
    )
    return report


def _print_report(report) -> None:
    s = report["shape"]
    print(
        f"routemm demo: {report['model']} expert projection (E={s['n_experts']}, top_k={s['top_k']}, "
        f"n={s['n']}, k={s['k']}, {report['weight_dtype']} weights) on {report['backend']} ({report['device']})"
    )
    print(f"{'m':>6} {'route':>16} {'time_us':>10} {'GB/s':>8} {'GFLOP/s':>9} {'max rel err':>12}  dispatches")
    for r in report["runs"]:
        labels = ", ".join(f"{d['pipeline_label']} grid={tuple(d['grid'])}" for d in r["dispatches"])
        print(
            f"{r['m']:>6} {r['route']:>16} {r['time_us']:>10.1f} {r['GBps']:>8.2f} {r['GFLOPs']:>9.2f} "
            f"{r['max_rel_error']:>12.2e}  {labels}"
        )
    for key, value in report.items():
        if key.startswith("routes_bit_identical"):
            print(f"direct and grouped_prefill bit-identical ({key.rsplit('_', 1)[1]}): {value}")
    print("OK" if report["ok"] else "FAILED: an output differs from the float64 reference")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routemm demo", description=__doc__)
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="full sizes of this model's expert projection (default: a reduced Qwen3-30B-A3B layer)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the prefill run (default 64)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weight dtype (default bf16)")
    parser.add_argument("--backend", default=None, help="cpu, cuda or metal (default: best available)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per route (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--gguf", metavar="FILE", default=None, help="run one MoE layer of this GGUF model instead")
    parser.add_argument("--layer", type=int, default=0, help="the layer --gguf runs (default 0)")
    args = parser.parse_args(argv)
    if args.gguf is not None:
        return _gguf_main(args, parser)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    started = time.perf_counter()
    report = run(args.model, args.tokens, args.dtype, args.backend, args.repeats, args.seed)
    report["elapsed_s"] = time.perf_counter() - started
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        print()
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


def _gguf_main(args, parser) -> int:
    """--gguf: one MoE layer of a GGUF file against its float64 reference (routemm.gguf_demo)."""
    from . import gguf_demo

    if args.tokens < 1 or args.layer < 0:
        parser.error("--tokens must be positive and --layer non-negative")
    report = gguf_demo.run(args.gguf, args.layer, args.tokens, args.backend, args.seed)
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        print()
    else:
        gguf_demo.print_report(report)
    return 0 if report["ok"] else 1
