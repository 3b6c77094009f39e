"""The quantised expert-ID matmul on Q4_K / Q6_K / MXFP4 expert stacks (any kernel format with
--types), timed on CUDA beside the copy floor of the touched experts' bytes.

    python3 bench/tools/qid_format_timing.py [--out DIR] [--types q4_k,q6_k,mxfp4]
        [--shapes qwen3-30b-a3b,gpt-oss-20b] [--ms 1,8,32,512,4096] [--budget-s 400]
    python3 bench/tools/qid_format_timing.py --smoke [--out DIR]   # small shapes on the CPU backend

With m > 8 the tensor-core route grouped_tensor_lowp is timed too where the backend registers it
(checked within TENSOR_TOLERANCE relative error per checked row).

Shapes (experts, top_k, hidden, intermediate): Qwen3-30B-A3B (128, 8, 2048, 768) and gpt-oss-20b
(32, 4, 2880, 2880); each as its up projection (n = intermediate, k = hidden; gate and up have the
same shape) and its down projection (n = hidden, k = intermediate). A K-quant needs K a multiple
of 256: gpt-oss-20b's K = 2880 is not (its GGUF experts are MXFP4), so those cases are recorded as
skipped. Each (shape, projection, type, m) runs on the route routemm picks
(routemm.dense_matmul_id.auto_grouped, router ids distinct per token), on the same random blocks
(random codes under small binary16 scales, or random E8M0 exponents near 2^0).

Timing: every call takes the next of ID_SETS router-like id sets (top-k of random scores) and the
next of the stack's copies (>= ROTATE_BYTES in all), so no call finds its experts in L2; a batch of
CALLS calls is encoded into one encoder and timed by commit_wait_with_gpu_time (GPU start to end,
the routing map's kernel included on the grouped route), the median over BATCHES batches per call.
Copy floor: the touched experts' block bytes (the distinct ids of the call, times one expert's
matrix) at the device-to-device copy rate, measured with torch where it imports (read + write
bytes over the copy's time), else the nominal --copy-tbps; frac_floor = floor / time. Correctness:
each timed configuration's last output is checked on CHECK_ROWS rows against a float64 reference
on the dequantised experts (relative error TOLERANCE of the row's magnitude); a failure is
recorded (time NaN, note WRONG) and the tool exits 1.

Output: one JSON line per record on stdout (progress on stderr), DIR/qid_formats-TAG.json and a
Markdown table DIR/qid_formats-TAG.md (TAG: $CARD as bench/device_common.sh sets it, else gpu;
cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import GgmlQuantizedMatmulIdRoute as Route
from routemm import GgmlType
from routemm.dense_matmul_id import auto_grouped
from routemm.formats import ggml

SHAPES = {  # name: (experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
SMOKE_SHAPES = {"smoke": (8, 2, 512, 256)}
TYPES = ("q4_k", "q6_k", "mxfp4")
MS, SMOKE_MS = (1, 8, 32, 512, 4096), (1, 8, 33)
ROTATE_BYTES = 256 << 20
ID_SETS = 8
CALLS = 10
BATCHES = 5
CHECK_ROWS = 8
TOLERANCE = 1e-4
TENSOR_TOLERANCE = 1e-2  # relative Frobenius error of a checked row on grouped_tensor_lowp
HALF_FIELDS = {
    "q4_0": (0,),
    "q8_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def kernel_format(name: str):
    """(block values, block bytes) of a GGML block format (Q4_0 and Q8_0 included, for the tools
    that time them beside the others)."""
    try:
        fmt = ggml.block_format(name)
    except (routemm.Error, ValueError):
        raise SystemExit(f"unknown block format {name!r}") from None
    return fmt.block_values, fmt.block_bytes


def random_stack(rng, name: str, experts: int, n: int, k: int) -> np.ndarray:
    """[experts, n, k / values * bytes] random blocks with finite small scales."""
    values, block_bytes = kernel_format(name)
    blocks = rng.integers(0, 256, (experts, n, k // values, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS.get(name, ()):
        d = rng.uniform(1e-3, 1e-2, blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset : offset + 2] = d[..., None].view(np.uint8).reshape(*d.shape, 2)
    if name == "mxfp4":
        blocks[..., 0] = rng.integers(118, 124, blocks.shape[:-1])
    return blocks.reshape(experts, n, -1)


def copy_rate(nominal_tbps: float, smoke: bool) -> tuple[float, str]:
    """Bytes per second of a device-to-device copy (read + write), and where the number came from."""
    if smoke:
        return nominal_tbps * 1e12, "nominal"
    try:
        import torch
    except ImportError:
        return nominal_tbps * 1e12, "nominal (no torch)"
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(samples), "measured (torch copy)"


def time_calls(device, encode, smoke: bool) -> float:
    """Seconds per call: GPU interval of CALLS calls in one encoder, median over BATCHES."""
    enc = device.command_encoder()
    encode(enc, 0)
    enc.commit_and_wait()  # warm-up
    samples = []
    for b in range(BATCHES):
        enc = device.command_encoder()
        if smoke:
            t0 = time.perf_counter()
            for i in range(CALLS):
                encode(enc, 1 + b * CALLS + i)
            enc.commit_and_wait()
            samples.append((time.perf_counter() - t0) / CALLS)
            continue
        for i in range(CALLS):
            encode(enc, 1 + b * CALLS + i)
        start, end = enc.commit_wait_with_gpu_time()
        samples.append((end - start) / CALLS)
    return statistics.median(samples)


def projection(shape: str, proj: str) -> tuple[int, int, int, int]:
    """(experts, top_k, n, k) of a shape's up or down projection."""
    experts, top_k, hidden, inter = (SHAPES | SMOKE_SHAPES)[shape]
    return (experts, top_k, inter, hidden) if proj == "up" else (experts, top_k, hidden, inter)


def weights(args, device, rng, shape, proj, name):
    """(host stack, device copies totalling >= ROTATE_BYTES), or None where K does not fit."""
    experts, _, n, k = projection(shape, proj)
    if k % kernel_format(name)[0] != 0:
        return None
    stack = random_stack(rng, name, experts, n, k)
    copies = 1 if args.smoke else max(1, min(4, math.ceil(ROTATE_BYTES / stack.nbytes)))
    return stack, [device.from_numpy(stack.reshape(-1)) for _ in range(copies)]


def run_case(args, device, registry, rng, copy_Bps, shape, proj, name, m, w, route=None) -> dict:
    """One timed configuration; route None: the automatic one."""
    experts, top_k, n, k = projection(shape, proj)
    values, _ = kernel_format(name)
    record = dict(shape=shape, proj=proj, type=name, m=m, n=n, k=k, experts=experts, top_k=top_k)
    if w is None:
        return record | dict(time_us=None, note=f"skipped: K {k} is not a multiple of {values}")
    ggml_type = GgmlType(name)
    stack, w_bufs = w
    copies = len(w_bufs)
    matrix = stack[0].nbytes
    x = rng.standard_normal((m, k), dtype=np.float32)
    x_buf = device.from_numpy(x)
    out = device.alloc(m * top_k * n * 4, routemm.DType.F32, [m * top_k, n])
    if route is None:
        route = Route.GROUPED if auto_grouped(device, m, top_k, experts, quantized=True) else Route.DIRECT
    grouped = route.is_grouped
    params = routemm.GgmlQuantizedMatmulIdParams(
        m, n, k, top_k, experts, ggml_type, matrix, Layout.SHARED_PER_TOKEN, route
    )
    scratch = routemm.DenseMatmulIdScratch(device, experts, m) if grouped else None
    id_sets = [np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.uint32) for _ in range(ID_SETS)]
    id_bufs = [device.from_numpy(ids) for ids in id_sets]

    def encode(enc, i):
        routemm.quantized_matmul_id_ggml(
            enc, registry, x_buf, w_bufs[i % copies], id_bufs[i % ID_SETS], out, scratch, params
        )

    seconds = time_calls(device, encode, args.smoke)
    # The last call ran id set (BATCHES * CALLS) % ID_SETS: check it.
    ids = id_sets[(BATCHES * CALLS) % ID_SETS]
    got = out.numpy()
    wrong = False
    for flat in np.linspace(0, m * top_k - 1, min(CHECK_ROWS, m * top_k)).astype(int):
        w = routemm.dequantize(stack[ids.reshape(-1)[flat]], ggml_type, (n, k)).astype(np.float64)
        prod = w * x[flat // top_k].astype(np.float64)[None, :]
        err = np.abs(got[flat] - prod.sum(axis=1))
        if route is Route.GROUPED_TENSOR_LOWP:
            wrong |= bool(np.linalg.norm(err) > TENSOR_TOLERANCE * np.linalg.norm(prod.sum(axis=1)))
        else:
            wrong |= bool(np.any(err > TOLERANCE * np.abs(prod).sum(axis=1) + 1e-30))
    touched = np.mean([len(np.unique(s)) for s in id_sets])
    floor_s = touched * matrix / (copy_Bps / 2)  # the copy rate counts read + write bytes
    return record | dict(
        route=route.value,
        time_us=None if wrong else seconds * 1e6,
        touched_experts=float(touched),
        touched_bytes=float(touched * matrix),
        floor_us=floor_s * 1e6,
        frac_floor=None if wrong else floor_s / seconds,
        TBps=None if wrong else touched * matrix / seconds / 1e12,
        note="WRONG" if wrong else "",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--copy-tbps", type=float, default=3.35, help="nominal copy rate without torch")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = routemm.Device("cpu" if args.smoke else "cuda")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(20261207)
    copy_Bps, copy_source = copy_rate(args.copy_tbps, args.smoke)
    log(f"copy rate {copy_Bps / 1e12:.3f} TB/s (read + write), {copy_source}")
    shapes = list(SMOKE_SHAPES) if args.smoke else args.shapes.split(",")
    ms = SMOKE_MS if args.smoke else tuple(int(v) for v in args.ms.split(","))
    deadline = time.monotonic() + args.budget_s
    records, failed = [], False
    for shape in shapes:
        for proj in ("up", "down"):
            for name in args.types.split(","):
                w = weights(args, device, rng, shape, proj, name)
                for m in ms:
                    if time.monotonic() > deadline:
                        log(f"budget spent: {shape} {proj} {name} m={m} and later cases not run")
                        break
                    routes = [None]
                    lowp = f"quantized_matmul_id_grouped_lowp_{name}_f32"
                    if m > 8 and w is not None and registry.has_kernel(lowp):
                        routes.append(Route.GROUPED_TENSOR_LOWP)
                    for route in routes:
                        r = run_case(args, device, registry, rng, copy_Bps, shape, proj, name, m, w, route)
                        r |= dict(copy_TBps=copy_Bps / 1e12, copy_source=copy_source)
                        failed |= r.get("note") == "WRONG"
                        records.append(r)
                        print(json.dumps(r), flush=True)
                        log(
                            f"{shape} {proj} {name} m={m}: {r.get('route', '-')} "
                            f"{r['time_us'] if r['time_us'] is None else round(r['time_us'], 1)} us "
                            f"floor {r.get('floor_us', float('nan')):.1f} us {r['note']}"
                        )
    tag = "cpu-smoke" if args.smoke else os.environ.get("CARD", "gpu")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"qid_formats-{tag}.json"), "w") as f:
        json.dump({"benchmark": "qid_formats", "device": tag, "records": records}, f, indent=1)
    lines = [
        "| shape | proj | type | m | route | time us | floor us | frac floor | TB/s | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        t = "-" if r["time_us"] is None else f"{r['time_us']:.1f}"
        fl = "-" if "floor_us" not in r else f"{r['floor_us']:.1f}"
        frac = "-" if r.get("frac_floor") is None else f"{r['frac_floor']:.2f}"
        tb = "-" if r.get("TBps") is None else f"{r['TBps']:.2f}"
        lines.append(
            f"| {r['shape']} | {r['proj']} | {r['type']} | {r['m']} | {r.get('route', '-')} | {t} | {fl} | "
            f"{frac} | {tb} | {r['note']} |"
        )
    with open(os.path.join(args.out, f"qid_formats-{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
