"""Host-side cost of one dense_matmul_id call (validation + encode), on an otherwise empty stream.

    python3 bench/host_cost.py OUT.json [--device cuda|cpu] [--calls N] [--batches B]

Two protocols, both with perf_counter_ns and commit_and_wait outside the timer, so kernel execution
is not counted (on CUDA a call includes its kernel launch, which is host work; the CPU backend's
encoders are dropped uncommitted, since it runs the work at commit):
  * `empty_stream` (the target's protocol): each call timed alone into a fresh encoder, the previous
    call's work waited for first, so the stream is idle at every call; median over calls * batches;
  * `back_to_back`: each batch encodes `calls` calls into one fresh encoder; median per call over
    batches. A kernel that runs longer than the host cost (the m = 1 direct kernel: ~9 us) makes the
    GPU fall behind, and the later launches of a batch go in behind a growing queue.
Two layers are timed:
  * `front_door`: routemm.dense_matmul_id(...) as users call it (params built once, reused);
  * `native`: the pybind11 entry underneath it, i.e. the C++ validation + encode plus the binding.
Shapes: the Qwen3-30B-A3B expert projection (E=128, top_k=8, n=768, k=2048, bf16) at m=1 (direct)
and m=512 (grouped_prefill: map + grouped dispatch, with the leading scratch barrier).
The median per-call time is reported (time_us), with min and max beside it. The target (issue 3):
under 5 us per call on an empty stream.

On CUDA, when nvcc is on PATH, the bare-launch floor of the same host is measured just before and
just after (bench/lab/launch_cost.cu, both protocols; `--no-launch-floor` skips it) and recorded
beside the records: the launch alone drifts by microseconds between hosts and runs, so a per-call
time means little without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import routemm
from routemm import DenseMatmulIdRoute as Route
from routemm import DType, _core

SHAPE = ("qwen3-30b-a3b", 128, 8, 768, 2048)  # name, E, top_k, n, k
TARGET_US = 5.0


def build_case(device, m: int, route: Route):
    name, E, top_k, n, k = SHAPE
    rng = np.random.default_rng(0)
    weights = device.alloc(E * n * k * 2, DType.BF16)
    x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    ids = np.stack([rng.permutation(E)[:top_k] for _ in range(m)]).astype(np.uint32)
    id_buf = device.from_numpy(ids)
    out = device.alloc(m * top_k * n * 4, DType.F32)
    params = routemm.DenseMatmulIdParams(
        m=m,
        n=n,
        k=k,
        top_k=top_k,
        n_experts=E,
        expert_stride_bytes=n * k * 2,
        input_layout=routemm.DenseMatmulIdInputLayout.SHARED_PER_TOKEN,
        id_multiplicity=routemm.DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN,
        route=route,
    )
    scratch = routemm.DenseMatmulIdScratch(device, E, m) if route is Route.GROUPED_PREFILL else None
    return dict(weights=weights, input=x, ids=id_buf, out=out, params=params, scratch=scratch)


def time_encoders(device, registry, case, layer: str, encoders: int, calls: int) -> list[float]:
    """Per-call host times (us), one per encoder: `encoders` fresh encoders (plus a first one that
    warms caches and is dropped), each timed over `calls` back-to-back calls, then committed and
    waited for outside the timer, so the stream is idle when the next encoder's timer starts.
    calls == 1 is the issue's empty-stream protocol; with many calls per encoder the GPU falls
    behind a kernel longer than the host cost and the later launches go in behind a growing queue."""
    w, x, ids, out, params, scratch = (case[key] for key in ("weights", "input", "ids", "out", "params", "scratch"))
    if layer == "front_door":
        fn, rest = routemm.dense_matmul_id, (registry, w, x, ids, out, scratch, params)
    else:
        fn, rest = _core._dense_matmul_id, (registry, w, x, ids, out, scratch, params._native_params)
    per_call = []
    for _ in range(encoders + 1):
        enc = device.command_encoder()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(enc, *rest)
        t1 = time.perf_counter_ns()
        if device.backend != "cpu":  # the CPU backend runs the work at commit: not needed here
            enc.commit_and_wait()
        per_call.append((t1 - t0) / calls / 1e3)
    return per_call[1:]


LAB_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab", "launch_cost.cu")


def build_launch_floor(workdir: str) -> str | None:
    """Compiles the bare-launch lab for this host's GPU; None (with the reason printed) if it can't."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("launch floor: nvcc not found, not measured", flush=True)
        return None
    exe = os.path.join(workdir, "launch_cost")
    cmd = [nvcc, "-std=c++20", "-arch=native", "-O3", "-cudart", "static", "-o", exe, LAB_LAUNCH]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"launch floor: build failed, not measured: {proc.stderr.strip()[-300:]}", flush=True)
        return None
    return exe


def run_launch_floor(exe: str, calls: int, batches: int) -> dict | None:
    """Per-call medians (us) of the lab's three launch variants, keyed by their labels."""
    proc = subprocess.run([exe, str(calls), str(batches)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"launch floor: run failed: {proc.stderr.strip()[-300:]}", flush=True)
        return None
    found = re.findall(r"^(.+): ([0-9.]+) us/call$", proc.stdout, re.MULTILINE)
    return {label: float(value) for label, value in found} or None


def table(doc) -> str:
    lines = [
        f"# dense_matmul_id host cost on {doc['device']} (git {doc['git_rev']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        "Per-call host time of validation + encode (CUDA: including the kernel launch), commit outside the timer. "
        "Protocols: `empty_stream` times each call alone on an idle stream (median over calls; the issue's "
        "protocol); `back_to_back` times batches of calls into one encoder (median over batches), where "
        "kernels longer than the host cost leave the launches behind a growing queue. Target: under 5 us.",
        "",
        "| shape | dtype | m | route | layer | protocol | time (us) | min | max | target met |",
        "|---|---|---:|---|---|---|---:|---:|---:|---|",
    ]
    for r in doc["records"]:
        lines.append(
            f"| {r['shape']} | {r['weight_dtype']} | {r['m']} | {r['route']} | {r['layer']} | {r.get('protocol', 'back_to_back')} | {r['time_us']:.2f} | "
            f"{r['min_us']:.2f} | {r['max_us']:.2f} | {'yes' if r['time_us'] < TARGET_US else 'no'} |"
        )
    floor = doc.get("bare_launch_us") or {}
    if floor:
        lines += ["", "Bare kernel launch on the same host (bench/lab/launch_cost.cu, same protocol), us per call:", ""]
        for when in ("before", "after"):
            if floor.get(when):
                lines.append(f"- {when}: " + "; ".join(f"{k} {v:.2f}" for k, v in floor[when].items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: the best available)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--no-launch-floor", action="store_true", help="skip the bare-launch measurement on CUDA")
    args = ap.parse_args()
    device = routemm.Device(args.device) if args.device else routemm.Device()
    registry = routemm.KernelRegistry(device)
    records = []
    floor = {}
    workdir = tempfile.TemporaryDirectory() if device.backend == "cuda" and not args.no_launch_floor else None
    exe = build_launch_floor(workdir.name) if workdir else None
    if exe:
        floor["before"] = run_launch_floor(exe, args.calls, args.batches)
    for m, route in [(1, Route.DIRECT), (512, Route.GROUPED_PREFILL)]:
        case = build_case(device, m, route)
        for protocol, layer in itertools.product(("empty_stream", "back_to_back"), ("front_door", "native")):
            if protocol == "empty_stream":
                times = time_encoders(device, registry, case, layer, args.calls * args.batches, 1)
            else:
                times = time_encoders(device, registry, case, layer, args.batches, args.calls)
            rec = {
                "op": "dense_matmul_id_host_cost",
                "shape": SHAPE[0],
                "m": m,
                "weight_dtype": "bf16",
                "route": route.value,
                "impl": "routemm",
                "layer": layer,
                "protocol": protocol,
                "time_us": statistics.median(times),
                "min_us": min(times),
                "max_us": max(times),
                "calls_per_batch": args.calls,
                "batches": args.batches,
            }
            records.append(rec)
            print(
                f"m={m} {route.value} {layer} {protocol}: {rec['time_us']:.2f} us/call (min {rec['min_us']:.2f})",
                flush=True,
            )
    if exe:
        floor["after"] = run_launch_floor(exe, args.calls, args.batches)
    if workdir:
        workdir.cleanup()
    doc = {
        "device": str(device),
        "git_rev": os.environ.get("GIT_REV", "unknown"),
        "command": os.environ.get("BENCH_COMMAND", " ".join(["python3"] + sys.argv)),
        "ceilings": {},
        "target_us": TARGET_US,
        "records": records,
    }
    if floor:
        doc["bare_launch_us"] = floor
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    md = table(doc)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
