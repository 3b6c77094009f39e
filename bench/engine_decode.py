"""routemm inside a decode loop: host cost of one eager torch op call, and a 48-layer decode step
captured as one CUDA graph.

    python3 bench/engine_decode.py host-cost OUT.json [--calls N] [--batches B] [--smoke | --cpu-tiny]
    python3 bench/engine_decode.py decode-graph OUT.json [--layers L] [--replays R] [--ggml-type q4_0|q8_0] [--smoke]

host-cost: one eager `torch.ops.routemm.matmul_id` call on the current stream (Qwen3-30B-A3B expert
projection: 128 experts, top_k 8, n 768, k 2048, bf16 weights, m = 1), timed on the host with
perf_counter_ns, back to back into the stream and synchronised outside the timer; median per call.
`torch.ops.routemm.quantized_matmul_id` is timed the same way on the shape as a Q4_0 stack.
The op runs the kernels routemm.torch loaded (the record's `kernels`: "cpp" for routemm._torch_ops,
"python" otherwise, e.g. with ROUTEMM_TORCH_KERNELS=python); the Python kernel is also timed in the
same run behind a torch op of its own (routemm_bench::matmul_id_python, registered as routemm's ops
are), so both kernel sets are compared on one machine. Beside them: a bare launch (bench/lab/launch_cost.cu, built with nvcc when present:
the same protocol, an empty kernel and one with the direct kernel's parameter footprint) and, as a
second floor, one small PyTorch op on the same stream. During a separate counted pass it records the
host syncs (torch.cuda.set_sync_debug_mode("error") raises on any), PyTorch's cudaMalloc segments,
and routemm's own counters (streams created, device allocations, host waits). The target: routemm's
call costs at most the bare launch of its kernel plus 2 us, with 0 syncs, 0 cudaMalloc, 0 streams.

decode-graph: the MoE expert projections of a Qwen3-30B-A3B decode step (m = 1): per layer gate
and up ([768, 2048] per expert, shared activation) and down ([2048, 768], one input row per slot),
48 layers, each with its own weights (58 GB of bf16 on the device; --layers lowers it). Timed with
CUDA events, median over replays: eager (the 144 calls launched one by one), the same step captured
with torch.cuda.graph and replayed, the sum of the kernel times of one replay (torch.profiler), and
the torch._grouped_mm formulation of the same step (rows sorted by expert on the device, per-expert
offsets from a device-side count), eager and captured. The target: replay within 10% of the sum of
its kernels' times. --ggml-type q4_0 (or q8_0) runs the same step over GGML block stacks through
torch.ops.routemm.quantized_matmul_id (16 GB of Q4_0 for 48 layers; random codes under one small
f16 scale, drawn on the device: the time does not depend on the values); torch._grouped_mm has no
block-stack form and is left out.

--smoke runs either on the CPU backend with tiny shapes (the suite runs it; no timing claims).
--cpu-tiny runs host-cost on the CPU backend at m = 1, n 16, k 32, 4 experts, top_k 2: the host cost
of the kernel sets where the work itself is negligible.
Results follow DESIGN.md's format (device, git_rev, command, records).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import routemm
import routemm.torch  # noqa: F401  (registers torch.ops.routemm.*)
import torch
from routemm.ops.quantized_matmul_id import SUPPORTED_TYPES

QWEN3 = {"name": "qwen3-30b-a3b", "experts": 128, "top_k": 8, "hidden": 2048, "inter": 768, "layers": 48}
SMOKE = {"name": "smoke", "experts": 8, "top_k": 2, "hidden": 64, "inter": 32, "layers": 2}
TINY = {"name": "tiny", "experts": 4, "top_k": 2, "hidden": 32, "inter": 16, "layers": 1}


def _git_rev() -> str:
    rev = os.environ.get("GIT_REV")
    if rev:
        return rev
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _document(records, device_name: str) -> dict:
    return {
        "device": device_name,
        "git_rev": _git_rev(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "ceilings": {"copy_TBps": 4.17, "bf16_TFLOPs": 794},
        "records": records,
    }


def _record(shape: dict, impl: str, time_us: float, route: str, m: int = 1, ggml_type=None, **extra) -> dict:
    return {
        "op": "dense_matmul_id" if ggml_type is None else "quantized_matmul_id",
        "shape": shape["name"],
        "m": m,
        "weight_dtype": ggml_type or "bf16",
        "route": route,
        "impl": impl,
        "time_us": round(time_us, 3),
        **extra,
    }


# ---- host cost ----------------------------------------------------------------------------------


def _launch_floor() -> dict:
    """The bare-launch floor from bench/lab/launch_cost.cu, or {} without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return {}
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab", "launch_cost.cu")
    exe = os.path.join(tempfile.mkdtemp(), "launch_cost")
    subprocess.run([nvcc, "-std=c++20", "-arch=sm_90a", "-O3", "-cudart", "static", "-o", exe, source], check=True)
    out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    return {"launch_cost_output": out.strip().splitlines()}


def _per_call_us(fn, calls: int, batches: int, sync) -> list[float]:
    times = []
    for batch in range(batches + 1):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter_ns()
        sync()
        if batch:  # the first batch warms up
            times.append((t1 - t0) / calls / 1e3)
    return times


def _python_op_floor():
    """torch.ops.routemm_bench.empty_result: registered as routemm's ops are (torch.library.Library
    per dispatch key), with a kernel that only allocates the result, so its time is the floor of
    a Python-implemented torch op."""
    lib = torch.library.Library("routemm_bench", "DEF")
    lib.define("empty_result(Tensor w, Tensor x, Tensor ids) -> Tensor")

    def kernel(w, x, ids):
        return x.new_empty((ids.shape[0] * ids.shape[1], w.shape[1]))

    for key in ("CPU", "CUDA"):
        lib.impl("empty_result", kernel, key)
    # The Python kernel of routemm::matmul_id behind an op of its own, so that it is timed in the
    # same process as whichever kernels routemm::matmul_id runs.
    lib.define("matmul_id_python(Tensor w, Tensor x, Tensor ids) -> Tensor")
    for key in ("CPU", "CUDA"):
        lib.impl("matmul_id_python", routemm.torch._matmul_id, key)
    _python_op_floor.library = lib  # keeps the registration alive
    return torch.ops.routemm_bench.empty_result


def host_cost(args) -> dict:
    shape = SMOKE if args.smoke else TINY if args.cpu_tiny else QWEN3
    cuda = not (args.smoke or args.cpu_tiny)
    dev = "cuda" if cuda else "cpu"
    e, top_k, n, k = shape["experts"], shape["top_k"], shape["inter"], shape["hidden"]
    w = torch.randn(e, n, k, device=dev).to(torch.bfloat16)
    x = torch.randn(1, k, device=dev)
    ids = torch.randperm(e, device=dev)[:top_k].reshape(1, top_k).to(torch.int32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    call = lambda: torch.ops.routemm.matmul_id(w, x, ids)  # noqa: E731
    small = lambda: x.add_(0.0)  # noqa: E731
    floor_op = _python_op_floor()
    empty_op = lambda: floor_op(w, x, ids)  # noqa: E731
    python_kernel = lambda: torch.ops.routemm_bench.matmul_id_python(w, x, ids)  # noqa: E731
    call()
    assert torch.equal(python_kernel(), call())
    sync()
    front = lambda: routemm.matmul_id(w, x, ids)  # noqa: E731  (the same call without torch.ops)
    front()
    stack = _block_stack(e, n, k, "q4_0", dev, torch.Generator(device=dev).manual_seed(0))
    quantized = lambda: torch.ops.routemm.quantized_matmul_id(stack, x, ids, "q4_0")  # noqa: E731
    quantized()
    # The whole experts block on the model's dtype, as transformers' "routemm" experts call it.
    gate_up = torch.randn(e, 2 * n, k, device=dev).to(torch.bfloat16)
    down = torch.randn(e, k, n, device=dev).to(torch.bfloat16)
    xb, wb = x.bfloat16(), torch.rand(1, top_k, device=dev).bfloat16()
    block = lambda: torch.ops.routemm.moe_experts(xb, ids, wb, gate_up, down)  # noqa: E731
    block()
    routemm_us = _per_call_us(call, args.calls, args.batches, sync)
    block_us = _per_call_us(block, args.calls, args.batches, sync)
    front_us = _per_call_us(front, args.calls, args.batches, sync)
    torch_us = _per_call_us(small, args.calls, args.batches, sync)
    op_floor_us = _per_call_us(empty_op, args.calls, args.batches, sync)
    python_kernel_us = _per_call_us(python_kernel, args.calls, args.batches, sync)
    quantized_us = _per_call_us(quantized, args.calls, args.batches, sync)
    # Counted pass: syncs raise, allocations and streams are counted.
    routemm.reset_encoder_counters()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) if cuda else 0
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(args.calls):
            call()
        syncs = 0
    except RuntimeError as error:  # set_sync_debug_mode("error") raised: a sync on the call path
        syncs = 1
        print("sync on the call path:", error, file=sys.stderr)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    counters = routemm.encoder_counters()
    mallocs = (torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments) if cuda else 0
    floor = _launch_floor() if cuda else {}
    counted = {
        "host_syncs": syncs,
        "torch_cudamalloc_segments": mallocs,
        "routemm_streams_created": counters["streams_created"],
        "routemm_device_allocations": counters["device_allocations"],
        "routemm_host_waits": counters["host_waits"],
        "calls": args.calls,
    }
    records = [
        _record(
            shape,
            "routemm_torch_op_eager",
            statistics.median(routemm_us),
            "direct",
            min_us=round(min(routemm_us), 3),
            max_us=round(max(routemm_us), 3),
            protocol="host time per call, back to back on the current stream",
            kernels=routemm.torch.KERNELS,
            **counted,
        ),
        _record(
            shape,
            "routemm_torch_op_python_kernel",
            statistics.median(python_kernel_us),
            "direct",
            min_us=round(min(python_kernel_us), 3),
            max_us=round(max(python_kernel_us), 3),
            protocol="host time per call of routemm::matmul_id's Python kernel behind a torch op of its own",
            kernels="python",
        ),
        _record(
            shape,
            "routemm_matmul_id_eager",
            statistics.median(front_us),
            "direct",
            min_us=round(min(front_us), 3),
            protocol="host time per call of routemm.matmul_id on the same tensors, back to back",
        ),
        _record(
            shape,
            "routemm_torch_op_eager",
            statistics.median(quantized_us),
            "direct",
            ggml_type="q4_0",
            min_us=round(min(quantized_us), 3),
            max_us=round(max(quantized_us), 3),
            protocol="host time per call of torch.ops.routemm.quantized_matmul_id on the same shape "
            "as a Q4_0 stack, back to back on the current stream",
            kernels=routemm.torch.KERNELS,
        ),
        _record(
            shape,
            "routemm_moe_experts_op_eager",
            statistics.median(block_us),
            "direct",
            min_us=round(min(block_us), 3),
            max_us=round(max(block_us), 3),
            protocol="host time per call of torch.ops.routemm.moe_experts (bf16 hidden, gate_up [E, 2n, k] "
            "and down [E, k, n] bf16, m = 1), back to back on the current stream",
            kernels=routemm.torch.KERNELS,
        ),
        _record(shape, "torch_add_inplace_floor", statistics.median(torch_us), "n/a"),
        _record(
            shape,
            "torch_python_op_floor",
            statistics.median(op_floor_us),
            "n/a",
            protocol="a torch.library op registered like routemm's whose Python kernel only returns "
            "a new [m * top_k, n] tensor: the host cost of any Python-implemented torch op",
        ),
    ]
    doc = _document(records, torch.cuda.get_device_name() if cuda else "cpu")
    doc.update(floor)
    return doc


# ---- decode graph -------------------------------------------------------------------------------


# The GGML block stacks --ggml-type takes.
BLOCK_TYPES = tuple(t.value for t in SUPPORTED_TYPES)


def _block_stack(e: int, rows: int, cols: int, ggml_type: str, dev, g) -> torch.Tensor:
    """A uint8 block stack [e, rows, cols / 32 * block_bytes] of random codes under one small f16
    scale (0.0101), drawn on the device: timing does not depend on the values."""
    values, block_bytes = routemm.GgmlType(ggml_type).block_layout
    shape = (e, rows, cols // values, block_bytes)
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=g)
    blocks[..., :2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8, device=dev)
    return blocks.reshape(e, rows, -1)


class Layer:
    def __init__(self, shape, dev, seed, ggml_type=None):
        # Drawn on the device itself: 58 GB of weights drawn on the host would take minutes.
        g = torch.Generator(device=dev).manual_seed(seed)
        e, n, k = shape["experts"], shape["inter"], shape["hidden"]

        def stack(rows, cols):
            if ggml_type is None:
                w = torch.empty(e, rows, cols, dtype=torch.bfloat16, device=dev)
                return w.normal_(0.0, 0.02, generator=g)
            return _block_stack(e, rows, cols, ggml_type, dev, g)

        self.gate, self.up, self.down = stack(n, k), stack(n, k), stack(k, n)


def _routemm_step(layers, x, ids, ggml_type=None):
    """Gate, up and down expert projections of every layer (the combine is not part of the bench)."""
    top_k = ids.shape[1]

    def project(w, h):
        if ggml_type is None:
            return torch.ops.routemm.matmul_id(w, h, ids)
        return torch.ops.routemm.quantized_matmul_id(w, h, ids, ggml_type)

    for layer in layers:
        g = project(layer.gate, x)
        u = project(layer.up, x)
        h = (g * u).reshape(x.shape[0], top_k, -1)
        project(layer.down, h)


def _grouped_mm_step(layers, x, ids):
    """The same projections with torch._grouped_mm: rows sorted by expert, offsets counted on the
    device (no host sync)."""
    e = layers[0].gate.shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat)
    # A scatter-add count, not torch.bincount: bincount reads the ids' maximum on the host to size
    # its output, a sync that CUDA graph capture refuses.
    counts = torch.zeros(e, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // ids.shape[1]
    xs = x[token].to(torch.bfloat16)
    for layer in layers:
        g = torch._grouped_mm(xs, layer.gate.transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(xs, layer.up.transpose(-2, -1), offs=offs)
        torch._grouped_mm(g * u, layer.down.transpose(-2, -1), offs=offs)


def _event_time_us(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def _kernel_sum_us(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total += event.device_time
    return total


def _captured(step, *args):
    step(*args)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*args)
    return graph


def decode_graph(args) -> dict:
    shape = dict(SMOKE if args.smoke else QWEN3)
    if args.layers:
        shape["layers"] = args.layers
    cuda = not args.smoke
    dev = "cuda" if cuda else "cpu"
    kind = args.ggml_type
    layers = [Layer(shape, dev, seed, kind) for seed in range(shape["layers"])]
    x = torch.randn(1, shape["hidden"], device=dev)
    ids = torch.randperm(shape["experts"], device=dev)[: shape["top_k"]].reshape(1, -1).to(torch.int32)
    calls = 3 * shape["layers"]
    extra = {"layers": shape["layers"], "expert_calls": calls, "ggml_type": kind}
    if not cuda:
        t0 = time.perf_counter()
        _routemm_step(layers, x, ids, kind)
        return _document(
            [_record(shape, "routemm_torch_op_eager_cpu", (time.perf_counter() - t0) * 1e6, "direct", **extra)], "cpu"
        )
    records = []
    eager = _event_time_us(lambda: _routemm_step(layers, x, ids, kind), args.replays)
    records.append(_record(shape, "routemm_torch_op_eager", statistics.median(eager), "direct", **extra))
    graph = _captured(_routemm_step, layers, x, ids, kind)
    replay = _event_time_us(graph.replay, args.replays)
    kernels = _kernel_sum_us(graph.replay)
    median = statistics.median(replay)
    records.append(
        _record(
            shape,
            "routemm_cuda_graph",
            median,
            "direct",
            sum_of_kernels_us=round(kernels, 3),
            replay_over_kernels=round(median / kernels, 4) if kernels else None,
            **extra,
        )
    )
    if kind is not None:
        return _document(records, torch.cuda.get_device_name())
    try:
        gm_eager = _event_time_us(lambda: _grouped_mm_step(layers, x, ids), args.replays)
        records.append(_record(shape, "torch_grouped_mm", statistics.median(gm_eager), "n/a", **extra))
        gm_graph = _captured(_grouped_mm_step, layers, x, ids)
        gm_replay = _event_time_us(gm_graph.replay, args.replays)
        records.append(_record(shape, "torch_grouped_mm_cuda_graph", statistics.median(gm_replay), "n/a", **extra))
    except (RuntimeError, AttributeError) as error:
        records.append({"op": "dense_matmul_id", "impl": "torch_grouped_mm", "error": str(error)[:500]})
    return _document(records, torch.cuda.get_device_name())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("host-cost")
    p.add_argument("out")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--batches", type=int, default=15)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cpu-tiny", action="store_true")
    p = sub.add_parser("decode-graph")
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--ggml-type", choices=BLOCK_TYPES, default=None)
    p.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    doc = host_cost(args) if args.what == "host-cost" else decode_graph(args)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for record in doc["records"]:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
