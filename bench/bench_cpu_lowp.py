"""The CPU expert-ID routes on the Qwen3-30B-A3B expert projection (128 experts of 768 x 2048, top-8):
each reduced-precision route beside the exact one it stands in for, and the exact routes' AVX-512
clone beside their AVX2 clone, in one run.

    python bench/bench_cpu_lowp.py bench/results/cpu_lowp-cpu.json [--ggml PATH/ggml_mul_mat_peer]

Every case is the minimum of 10 timed submissions after one warm-up, on 2 CPU threads, with the ids
of the case fixed (as ggml's test-backend-ops times a node: the 8 experts of a decode step, 25 MB of
bf16, may stay in the last-level cache). The AVX2-clone rows run in a child process with
ROUTEMM_CPU_ISA=avx2 (the knob is read once per process). With --ggml, ggml's CPU backend is timed
in the same run through bench/peer/ggml_mul_mat_peer (its `l2` mode: one weight and one ids tensor
reused; its value is the median of 10 batches of 4 nodes). The single-thread read bandwidth of a 512 MB buffer is
measured beside them. Writes the results format of DESIGN.md and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("ROUTEMM_CPU_THREADS", "2")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import routemm  # noqa: E402
from routemm import DenseMatmulIdRoute as Route  # noqa: E402

E, TOP_K, N, K = 128, 8, 768, 2048
SHAPE = "qwen3-30b-a3b"
RUNS = 10
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
# (weight dtype, m) -> routes; the exact routes first, then their reduced-precision counterparts.
CASES = {
    ("bf16", 1): ["direct", "direct_bf16_dot"],
    ("bf16", 8): ["direct", "grouped_prefill", "direct_bf16_dot", "grouped_bf16_dot"],
    ("bf16", 64): ["grouped_prefill", "grouped_bf16_dot"],
    ("bf16", 512): ["grouped_prefill", "grouped_bf16_dot"],
    ("f32", 1): ["direct"],
    ("f32", 512): ["grouped_prefill"],
}
EXACT = ("direct", "grouped_prefill")
BF16_DOT_PIPELINES = routemm.DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES
BENCH = Path(__file__).resolve().parent


def _time_route(device, registry, weights, x, ids, route: Route, m: int) -> tuple[float, float]:
    """(min, median) seconds of RUNS submissions of one call."""
    w_buf, x_buf, id_buf = device.from_numpy(weights), device.from_numpy(x), device.from_numpy(ids)
    out = device.from_numpy(np.zeros((m * TOP_K, N), np.float32))
    scratch = routemm.DenseMatmulIdScratch(device, E, m) if route.is_grouped else None
    params = routemm.DenseMatmulIdParams(m, N, K, TOP_K, E, N * K * weights.itemsize, route=route)
    times = []
    for i in range(RUNS + 1):
        encoder = device.command_encoder()
        routemm.dense_matmul_id(encoder, registry, w_buf, x_buf, id_buf, out, scratch, params)
        start = time.perf_counter()
        encoder.commit_and_wait()
        if i:  # the first submission warms up
            times.append(time.perf_counter() - start)
    return min(times), float(np.median(times))


def measure(exact_only: bool) -> list[dict]:
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(0)
    records = []
    for dtype in ("bf16", "f32"):
        weights = (rng.standard_normal((E, N, K), dtype=np.float32) * 0.02).astype(DTYPES[dtype])
        for (case_dtype, m), routes in CASES.items():
            if case_dtype != dtype:
                continue
            x = rng.standard_normal((m, K), dtype=np.float32)
            ids = np.argsort(rng.random((m, E)), axis=1)[:, :TOP_K].astype(np.uint32)
            touched = len(np.unique(ids))
            for name in routes:
                if exact_only and name not in EXACT:
                    continue
                route = Route(name)
                if name.endswith("bf16_dot") and not all(map(registry.has_kernel, BF16_DOT_PIPELINES)):
                    print(f"skip {dtype} m={m} {name}: this CPU has no AVX512_BF16", flush=True)
                    continue
                best, median = _time_route(device, registry, weights, x, ids, route, m)
                weight_bytes = touched * N * K * weights.itemsize
                flops = 2 * m * TOP_K * N * K
                records.append(
                    {
                        "op": "dense_matmul_id",
                        "shape": SHAPE,
                        "m": m,
                        "weight_dtype": dtype,
                        "route": name,
                        "impl": "routemm",
                        "time_us": best * 1e6,
                        "median_us": median * 1e6,
                        "bytes": weight_bytes,
                        "flops": flops,
                        "TBps": weight_bytes / best / 1e12,
                        "TFLOPs": flops / best / 1e12,
                        "note": f"min of {RUNS}",
                    }
                )
                print(f"{dtype} m={m} {name}: {best * 1e6:.0f} us (median {median * 1e6:.0f})", flush=True)
    return records


def _read_bandwidth_GBps() -> float:
    """Single-thread read bandwidth of a 512 MB buffer (NumPy sum, best of 5)."""
    data = np.ones(128 * 1024 * 1024, np.float32)
    best = min(_timed(lambda: data.sum()) for _ in range(5))
    return data.nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ggml_records(binary: str) -> list[dict]:
    ms = sorted({m for (dtype, m) in CASES if dtype == "bf16"})
    cmd = [binary, "--backend", "cpu", "--only", "mul_mat_id", "--moe-ms", ",".join(map(str, ms)), "--threads", "2"]
    cmd += ["--nodes", "4", "--reps", "1", "--batches", "10"]  # 10 timed graphs of 4 nodes per case
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600).stdout
    records = []
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        if not line.startswith("peer") or fields.get("type") != "bf16" or fields.get("mode") != "l2":
            continue
        m = int(fields["m"])
        records.append(
            {
                "op": "dense_matmul_id",
                "shape": SHAPE,
                "m": m,
                "weight_dtype": "bf16",
                "route": "mul_mat_id",
                "impl": "ggml_cpu",
                "time_us": float(fields["us"]),
                "flops": 2 * m * TOP_K * N * K,
                "note": "ggml_mul_mat_peer l2 mode, median of 10 batches, 2 threads",
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="results JSON path (a .md is written beside it)")
    parser.add_argument("--ggml", help="a built bench/peer/ggml_mul_mat_peer (CPU backend)")
    parser.add_argument("--exact-only", action="store_true", help=argparse.SUPPRESS)  # the AVX2 child
    args = parser.parse_args()
    if args.exact_only:
        json.dump(measure(exact_only=True), sys.stdout)
        return
    records = measure(exact_only=False)
    child = subprocess.run(
        [sys.executable, __file__, "--exact-only"],
        env=dict(os.environ, ROUTEMM_CPU_ISA="avx2"),
        capture_output=True,
        text=True,
        check=True,
    )
    for record in json.loads(child.stdout.strip().splitlines()[-1]):
        record["impl"] = "routemm_avx2_clone"
        records.append(record)
    if args.ggml:
        records += _ggml_records(args.ggml)
    if not args.out:
        return
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH / "conftest.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    doc = {
        "device": f"cpu: {harness._cpu_name()} ({os.cpu_count()} threads, 2 used)",
        "git_rev": harness._git_rev(),
        "command": "python " + " ".join(sys.argv),
        "ceilings": {"read_GBps_1_thread": _read_bandwidth_GBps()},
        "records": records,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(harness._markdown(doc))


if __name__ == "__main__":
    main()
