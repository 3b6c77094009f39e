"""The quantised expert-ID matmul and the MoE block on CUDA, timed per kernel beside PyTorch peers.

    python3 bench/tools/qid_timing.py [--out DIR] [--shapes ...] [--types q4_0,q8_0]
        [--ms 1,8,32,512,4096] [--modes matmul,block] [--budget-s 140]
    python3 bench/tools/qid_timing.py --smoke [--out DIR]      # small shapes on the CPU backend

matmul mode: quantized_matmul_id_ggml on Q4_0 / Q8_0 expert stacks of the Qwen3-30B-A3B (E 128,
top-8, n 768, k 2048) and Qwen3.6-35B-A3B (E 256, top-8, n 512, k 2048) projections at each m, on
the route routemm.matmul_id picks (routemm.dense_matmul_id.auto_grouped: router ids are distinct
per token; with --exact-both the other exact route as well). Beside it, in the same run and on the
same ids:
  - torch._grouped_mm on the dequantised bf16 stack (sort by expert, gather, grouped GEMM, scatter:
    every kernel of the call counted), and
  - the copy floor: the touched experts' block bytes at the copy rate measured here (a
    device-to-device copy of COPY_BYTES, read plus write bytes over its kernel time).
Weights rotate over copies of the stack totalling >= ROTATE_BYTES, and every call takes the next of
ID_SETS router-like id sets (top-k of random scores), so no call finds its experts in L2.
block mode: one Qwen3-30B-A3B MoE block (router linear, moe_gate, moe_experts; bf16 and Q4_0
experts; m = 1 and 4096) beside transformers' Qwen3MoeSparseMoeBlock with its grouped_mm and
batched_mm experts implementations on the bf16 weights (skipped, with a message, when transformers
cannot be imported).

Timing: on CUDA the summed kernel durations per call from the PyTorch profiler's CUDA trace
(bench_cuda_dense_matmul_id.gpu_events; host launch gaps excluded), over CALLS calls after a
warm-up; with --smoke the median wall time per call. Correctness: every routemm result is compared
on CHECK_ROWS rows with a float64 reference built from the dequantised blocks (bit-exact
dequantisation, checked against routemm.q4_0 / q8_0 first) within TOLERANCE (TENSOR_TOLERANCE for
grouped_tensor_lowp), and routemm.matmul_id(ggml_type=...) must give the automatic route's bits; a failed check is recorded (time NaN, note WRONG) and the
tool exits 1.

Output: one JSON line per record on stdout (progress on stderr), DIR/quantized_matmul_id-TAG.json
and DIR/moe_block-TAG.json in the results format of DESIGN.md with a Markdown table beside each
(TAG: $CARD as bench/device_common.sh sets it, else gpu; cpu-smoke). Imports neither torch nor
CUDA until it runs.
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
from routemm.dense_matmul_id import auto_grouped

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {  # name: (experts, top_k, n, k)
    "qwen3-30b-a3b": (128, 8, 768, 2048),
    "qwen3.6-35b-a3b": (256, 8, 512, 2048),
}
SMOKE_SHAPES = {"smoke": (16, 4, 64, 256)}
MS, SMOKE_MS = (1, 8, 32, 512, 4096), (1, 8, 33)
BLOCK = dict(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B's MoE block
SMOKE_BLOCK = dict(experts=16, top_k=4, hidden=256, inter=64)
BLOCK_MS, SMOKE_BLOCK_MS = (1, 4096), (1, 33)
ROTATE_BYTES = 256 << 20
COPY_BYTES = 1 << 30
ID_SETS = 8
CALLS = 10
CHECK_ROWS = 8
TOLERANCE = 1e-4  # max |got - ref| / max |ref|: exact dequantisation, F32 accumulation
TENSOR_TOLERANCE = 1e-2  # the same for grouped_tensor_lowp (activations rounded to f16)
BLOCK_TOLERANCE = 1e-3  # the block chains three F32 matmuls and the activation
CEILINGS = {"copy_TBps": 4.17}  # H200 nominal; the measured copy rate goes beside it


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---- Block formats in torch ------------------------------------------------------------------------


def random_blocks(torch, gen, shape, ggml_type: routemm.GgmlType, device):
    """Random uint8 blocks [*shape[:-1], k / 32 * block_bytes] with small positive f16 scales."""
    values, block_bytes = ggml_type.block_layout
    *lead, k = shape
    n_blocks = math.prod(lead) * (k // values)
    data = torch.randint(0, 256, (n_blocks, block_bytes), generator=gen, device=device, dtype=torch.uint8)
    scale = torch.rand((n_blocks, 1), generator=gen, device=device) * 0.01 + 0.001
    data[:, :2] = scale.to(torch.float16).view(torch.uint8)
    return data.reshape(*lead, k // values * block_bytes)


def dequantize(torch, blocks, ggml_type: routemm.GgmlType):
    """float32 [..., k] of uint8 blocks [..., k / 32 * block_bytes], exactly (ggml's block formats:
    Q4_0 value j of a block is d * (low nibble of byte j - 8), value j + 16 the high nibble's; Q8_0
    value j is d * int8 j)."""
    values, block_bytes = ggml_type.block_layout
    lead = blocks.shape[:-1]
    b = blocks.reshape(-1, block_bytes)
    d = b[:, :2].contiguous().view(torch.float16).float()
    payload = b[:, 2:]
    if ggml_type is routemm.GgmlType.Q4_0:
        q = torch.cat([payload & 0xF, payload >> 4], dim=1).float() - 8.0
    else:
        q = payload.contiguous().view(torch.int8).float()
    return (q * d).reshape(*lead, -1)


def check_dequantize(torch, blocks, ggml_type) -> None:
    """The torch dequantisation must equal routemm's codec on these blocks (one expert's worth)."""
    codec = routemm.q4_0 if ggml_type is routemm.GgmlType.Q4_0 else routemm.q8_0
    host = blocks.cpu().numpy()
    ours = dequantize(torch, blocks, ggml_type).cpu().numpy()
    if not np.array_equal(ours, codec.dequantize(host, ours.shape)):
        raise SystemExit(f"qid_timing: the torch {ggml_type.value} dequantisation differs from routemm's")


# ---- Timing ----------------------------------------------------------------------------------------


class Timer:
    """Seconds per call of fn(i): CUDA kernel time from the profiler trace, or CPU wall time."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda

    def __call__(self, fn, calls: int = CALLS) -> tuple[float, dict]:
        """(seconds per call, {kernel name: seconds per call}) over `calls` calls after a warm-up."""
        if not self.cuda:
            fn(0)
            samples = []
            for i in range(calls):
                start = time.perf_counter()
                fn(i + 1)
                samples.append(time.perf_counter() - start)
            return statistics.median(samples), {}
        import bench_cuda_dense_matmul_id as B

        split: dict = {}
        for e in B.gpu_events(fn, calls):
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                split[e["name"]] = split.get(e["name"], 0.0) + e["dur"] / 1e6 / calls
        return sum(split.values()), split

    def copy_rate(self, nbytes: int, device) -> float:
        """Bytes per second a device-to-device copy moves (read + write) over its kernel time."""
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        seconds, _ = self(lambda i: dst.copy_(src), calls=5)
        return 2 * nbytes / seconds


def map_note(split: dict) -> str:
    """'; map X us' from a per-kernel split (the routing map's kernels), or '' without one."""
    if not split:
        return ""
    return f"; map {sum(t for name, t in split.items() if 'map' in name) * 1e6:.1f} us"


# ---- matmul mode -----------------------------------------------------------------------------------


class Run:
    """What one invocation shares: torch, the devices, the timer, the records and the clock."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.smoke = args.smoke
        self.exact_both = getattr(args, "exact_both", False)
        self.tdev = "cpu" if args.smoke else "cuda"
        self.device = routemm.Device(self.tdev)
        self.registry = routemm.KernelRegistry(self.device)
        self.timer = Timer(torch, not args.smoke)
        self.deadline = time.monotonic() + args.budget_s
        self.failed = False
        self.copy_Bps = self.timer.copy_rate((4 << 20) if args.smoke else COPY_BYTES, self.tdev)
        log(f"copy rate {self.copy_Bps / 1e12:.3f} TB/s (read + write)")

    def out_of_time(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        log(f"!! {what}: skipped, the time budget is spent")
        return True

    def router_ids(self, gen, m: int, experts: int, top_k: int):
        import bench_cuda_dense_matmul_id as B

        return B.router_ids(gen, m, experts, top_k, device=self.tdev)

    def buffer(self, t):
        buf = routemm.from_dlpack(t)
        if t.dtype == self.torch.int32:  # expert ids: the same bits as U32
            buf = buf.view(0, buf.nbytes, routemm.DType.U32, list(t.shape))
        return buf


def emit(records: list, **record) -> None:
    records.append(record)
    print(json.dumps(record), flush=True)


def grouped_mm(torch, w, x, ids, n_experts: int, top_k: int):
    """torch._grouped_mm on bf16 weights [E, n, k]: out[flat] = w[ids[flat]] @ x[flat // top_k]."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=n_experts), 0).to(torch.int32)
    rows = torch._grouped_mm(x[order // top_k].to(torch.bfloat16), w.transpose(-2, -1), offs=offs)
    out = torch.empty((flat.numel(), w.shape[1]), dtype=torch.float32, device=x.device)
    out[order] = rows.float()
    return out


def matmul_case(run: Run, records, name, shape, ggml_type, m, stacks, deq_stacks, gen) -> None:
    torch = run.torch
    experts, top_k, n, k = shape
    copies = len(stacks)
    w_bufs = [run.buffer(s) for s in stacks]
    stride = stacks[0].shape[1] * stacks[0].shape[2]
    x = torch.randn((m, k), generator=gen, device=run.tdev)
    ids = [run.router_ids(gen, m, experts, top_k) for _ in range(ID_SETS)]
    x_buf, id_bufs = run.buffer(x), [run.buffer(i) for i in ids]
    out = torch.empty((m * top_k, n), device=run.tdev)
    out_buf = run.buffer(out)
    # matmul_id's choice for ids distinct per token
    grouped = auto_grouped(run.device, m, top_k, experts, quantized=True)
    auto = routemm.GgmlQuantizedMatmulIdRoute.GROUPED if grouped else routemm.GgmlQuantizedMatmulIdRoute.DIRECT
    routes = [auto]
    if run.exact_both and m > 1:  # the other exact route beside the automatic one
        routes.append(
            routemm.GgmlQuantizedMatmulIdRoute.DIRECT if grouped else routemm.GgmlQuantizedMatmulIdRoute.GROUPED
        )
    # The opt-in tensor-core route beside the exact one for m > 8 (as qid_format_timing.py), where
    # the backend registers it: the automatic route stays direct up to the grouped crossover
    # (m = 512 included on CUDA), which left the tensor route untimed there.
    lowp = routemm.GgmlQuantizedMatmulIdRoute.GROUPED_TENSOR_LOWP
    if m > 8 and all(run.registry.has_kernel(name) for name in lowp.pipelines(ggml_type)):
        routes.append(lowp)
    needs_map = any(r is not routemm.GgmlQuantizedMatmulIdRoute.DIRECT for r in routes)
    scratch = routemm.DenseMatmulIdScratch(run.device, experts, m) if needs_map else None
    touched = statistics.mean(int(torch.unique(i).numel()) for i in ids)
    weight_bytes = touched * stride
    flops = 2 * m * top_k * n * k
    base = dict(op="quantized_matmul_id", shape=name, m=m, weight_dtype=ggml_type.value, bytes=int(weight_bytes))
    flat_ids = ids[0].reshape(-1).long()
    rows = torch.arange(0, m * top_k, max(1, m * top_k // CHECK_ROWS), device=run.tdev)[:CHECK_ROWS]
    w_rows = dequantize(torch, stacks[0][flat_ids[rows]], ggml_type).double()
    want = torch.einsum("rnk,rk->rn", w_rows, x[rows // top_k].double())
    floor = weight_bytes / run.copy_Bps  # the touched bytes at the rate a copy moves bytes

    for route in routes:
        params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, experts, ggml_type, stride, route=route)

        def call(j, params=params):
            enc = run.device.command_encoder()
            routemm.quantized_matmul_id_ggml(
                enc, run.registry, x_buf, w_bufs[j % copies], id_bufs[j % ID_SETS], out_buf, scratch, params
            )
            enc.commit_and_wait()

        # Correctness on the first id set: float64 rows from the dequantised blocks, and for the
        # automatic route the high-level matmul_id giving the explicit front door's bits.
        call(0)
        got = out.clone()
        err = float((got[rows].double() - want).abs().max() / want.abs().max())
        same = route is not auto or bool(
            torch.equal(
                routemm.matmul_id(stacks[0], x, ids[0], ggml_type=ggml_type).view(torch.int32), got.view(torch.int32)
            )
        )
        tolerance = TENSOR_TOLERANCE if route is lowp else TOLERANCE
        if not (err <= tolerance and same and bool(torch.isfinite(got).all())):
            run.failed = True
            note = f"WRONG: rel err {err:.2e}, matmul_id {'same' if same else 'different'} bits"
            emit(records, **base, route=route.value, impl="routemm", time_us=float("nan"), note=note)
            log(f"!! {name} {ggml_type.value} m={m} {route.value}: {note}")
            return

        seconds, split = run.timer(call)
        emit(
            records, **base, route=route.value, impl="routemm", time_us=seconds * 1e6, flops=flops,
            TBps=weight_bytes / seconds / 1e12, TFLOPs=flops / seconds / 1e12,
            note=f"{touched:.1f} experts touched{map_note(split)}; {seconds / floor:.2f}x the copy floor; rel err {err:.1e}",
        )  # fmt: skip
    emit(
        records, **base, route="copy", impl="copy_floor", time_us=floor * 1e6, TBps=weight_bytes / floor / 1e12,
        note=f"touched block bytes at the measured copy rate ({run.copy_Bps / 1e12:.3f} TB/s, read + write)",
    )  # fmt: skip

    def peer(j):
        return grouped_mm(torch, deq_stacks[j % copies], x, ids[j % ID_SETS], experts, top_k)

    try:
        peer_out = peer(0)
        peer_err = float((peer_out[rows].double() - want).abs().max() / want.abs().max())
        p_seconds, _ = run.timer(peer)
    except (RuntimeError, NotImplementedError) as exc:  # e.g. no grouped GEMM for this device
        log(f"   torch._grouped_mm unavailable here: {str(exc).splitlines()[0][:120]}")
        return
    emit(
        records, **base, route="grouped_mm", impl="torch_grouped_mm", time_us=p_seconds * 1e6, flops=flops,
        TBps=weight_bytes / p_seconds / 1e12, TFLOPs=flops / p_seconds / 1e12,
        note=f"dequantised bf16 stack (bytes: the {ggml_type.value} ones); bf16 activations, rel err {peer_err:.1e}",
    )  # fmt: skip


def matmul_mode(run: Run, records, shapes, types, ms) -> None:
    torch = run.torch
    for name, shape in shapes.items():
        experts, top_k, n, k = shape
        for ggml_type in types:
            if run.out_of_time(f"{name} {ggml_type.value}"):
                return
            gen = torch.Generator(device=run.tdev)
            gen.manual_seed(7)
            values, block_bytes = ggml_type.block_layout
            stack_bytes = experts * n * (k // values) * block_bytes
            copies = 1 if run.smoke else max(1, math.ceil(ROTATE_BYTES / stack_bytes))
            stacks = [random_blocks(torch, gen, (experts, n, k), ggml_type, run.tdev) for _ in range(copies)]
            check_dequantize(torch, stacks[0][0], ggml_type)
            deq = [dequantize(torch, s, ggml_type).to(torch.bfloat16) for s in stacks]
            log(f"-- {name} {ggml_type.value}: {copies} copies of {stack_bytes / 2**20:.0f} MiB")
            for m in ms:
                if run.out_of_time(f"{name} {ggml_type.value} m={m}"):
                    return
                started = time.monotonic()
                matmul_case(run, records, name, shape, ggml_type, m, stacks, deq, gen)
                log(f"   m={m} took {time.monotonic() - started:.1f} s")
            del stacks, deq
            if not run.smoke:
                torch.cuda.empty_cache()


# ---- block mode ------------------------------------------------------------------------------------


def block_reference(torch, x, ids, weights, gate, up, down, rows):
    """float64 out[t] for t in rows: sum_s weights[t, s] * down[e] @ (SiLU(gate[e] @ x) * up[e] @ x)."""
    out = []
    for t in rows.tolist():
        xt = x[t].double()
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            g, u = gate(e).double() @ xt, up(e).double() @ xt
            acc += float(weights[t, s]) * (down(e).double() @ (g * torch.sigmoid(g) * u))
        out.append(acc)
    return torch.stack(out)


def transformers_block(cfg, router, gate_up, down, implementation: str, tdev):
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=cfg["hidden"], moe_intermediate_size=cfg["inter"], num_experts=cfg["experts"],
        num_experts_per_tok=cfg["top_k"], norm_topk_prob=True,
    )  # fmt: skip
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config).to(device=tdev, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block


def block_mode(run: Run, records, ms) -> None:
    torch = run.torch
    cfg = SMOKE_BLOCK if run.smoke else BLOCK
    experts, top_k, hidden, inter = cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["inter"]
    shape = "smoke-block" if run.smoke else "qwen3-30b-a3b"
    gen = torch.Generator(device=run.tdev)
    gen.manual_seed(11)
    router = torch.randn((experts, hidden), generator=gen, device=run.tdev) / hidden**0.5
    gate_up = (torch.randn((experts, 2 * inter, hidden), generator=gen, device=run.tdev) / hidden**0.5).bfloat16()
    down = (torch.randn((experts, hidden, inter), generator=gen, device=run.tdev) / inter**0.5).bfloat16()
    q4 = routemm.GgmlType.Q4_0
    q_gate, q_up = (random_blocks(torch, gen, (experts, inter, hidden), q4, run.tdev) for _ in range(2))
    q_down = random_blocks(torch, gen, (experts, hidden, inter), q4, run.tdev)
    variants = {
        "bf16": dict(
            stacks=(gate_up, down), ggml_type=None, gate=lambda e: gate_up[e, :inter], up=lambda e: gate_up[e, inter:],
            down=lambda e: down[e],
        ),
        "q4_0": dict(
            stacks=((q_gate, q_up), q_down), ggml_type=q4, gate=lambda e: dequantize(torch, q_gate[e], q4),
            up=lambda e: dequantize(torch, q_up[e], q4), down=lambda e: dequantize(torch, q_down[e], q4),
        ),
    }  # fmt: skip
    try:
        import transformers  # noqa: F401

        peers = {
            impl: transformers_block(cfg, router, gate_up, down, impl, run.tdev)
            for impl in ("grouped_mm", "batched_mm")
        }
    except ImportError as exc:
        log(f"   block peers skipped: transformers is not importable here ({exc})")
        peers = {}
    for m in ms:
        xs = [torch.randn((m, hidden), generator=gen, device=run.tdev) for _ in range(ID_SETS)]
        route = routemm.DenseMatmulIdRoute.GROUPED_PREFILL if m > 8 else routemm.DenseMatmulIdRoute.DIRECT
        for dtype_name, v in variants.items():
            if run.out_of_time(f"block {dtype_name} m={m}"):
                return
            stacks, ggml_type = v["stacks"], v["ggml_type"]

            def block(j, stacks=stacks, ggml_type=ggml_type):
                x = xs[j % ID_SETS]
                weights, ids = routemm.moe_gate(x @ router.T, top_k, renormalize=True)
                return routemm.moe_experts(x, ids, weights, *stacks, ggml_type=ggml_type, route=route), ids, weights

            got, ids, weights = block(0)
            rows = torch.arange(0, m, max(1, m // 4), device=run.tdev)[:4]
            want = block_reference(torch, xs[0], ids, weights, v["gate"], v["up"], v["down"], rows)
            err = float((got[rows].double() - want).abs().max() / want.abs().max())
            base = dict(op="moe_block", shape=shape, m=m, weight_dtype=dtype_name)
            if not err <= BLOCK_TOLERANCE:
                run.failed = True
                emit(
                    records,
                    **base,
                    route=route.value,
                    impl="routemm",
                    time_us=float("nan"),
                    note=f"WRONG: rel err {err:.2e}",
                )
                continue
            seconds, split = run.timer(block)
            emit(
                records, **base, route=route.value, impl="routemm", time_us=seconds * 1e6,
                note=f"router linear (torch f32) + moe_gate + moe_experts{map_note(split)}; rel err {err:.1e}",
            )  # fmt: skip
        for impl, peer_block in peers.items():
            if run.out_of_time(f"block {impl} m={m}"):
                return
            xb = [x.bfloat16().reshape(1, m, hidden) for x in xs]

            def peer(j, peer_block=peer_block, xb=xb):
                with torch.no_grad():
                    return peer_block(xb[j % ID_SETS])

            try:
                seconds, _ = run.timer(peer)
            except (RuntimeError, NotImplementedError) as exc:
                log(f"   transformers {impl} unavailable here: {str(exc).splitlines()[0][:120]}")
                continue
            emit(
                records, op="moe_block", shape=shape, m=m, weight_dtype="bf16", route=impl, impl=f"transformers_{impl}",
                time_us=seconds * 1e6, note=f"Qwen3MoeSparseMoeBlock, bf16 activations, torch {torch.__version__}",
            )  # fmt: skip


# ---- Output ----------------------------------------------------------------------------------------


def write(path: str, run: Run, records: list, command: str) -> None:
    from conftest import _markdown

    torch = run.torch
    doc = {
        "device": "CPU (smoke run)" if run.smoke else torch.cuda.get_device_name(0),
        "git_rev": os.environ.get("GIT_REV", "unknown"),
        "command": command,
        "ceilings": {**CEILINGS, "copy_TBps_measured_read_plus_write": run.copy_Bps / 1e12},
        "torch": torch.__version__,
        "records": records,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(_markdown(doc))
    log(f"wrote {path} and its .md")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/routemm-out"), help="output folder")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--types", default="q4_0,q8_0")
    ap.add_argument("--ms", default=None, help="comma list of token counts (default 1,8,32,512,4096)")
    ap.add_argument("--block-ms", default=None, help="block mode token counts (default 1,4096)")
    ap.add_argument("--modes", default="matmul,block")
    ap.add_argument("--budget-s", type=float, default=140.0, help="skip what is left after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU backend (no CUDA needed)")
    ap.add_argument(
        "--exact-both", action="store_true", help="time both exact routes (direct and grouped) at every m > 1"
    )
    args = ap.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run = Run(args)
    tag = "cpu-smoke" if args.smoke else os.environ.get("CARD", "gpu")
    command = os.environ.get("BENCH_COMMAND", " ".join(["python3", "bench/tools/qid_timing.py", *sys.argv[1:]]))
    modes = set(args.modes.split(","))
    if "matmul" in modes:
        shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
        types = [routemm.GgmlType(t) for t in args.types.split(",")]
        ms = [int(v) for v in args.ms.split(",")] if args.ms else (SMOKE_MS if args.smoke else MS)
        records: list = []
        try:
            matmul_mode(run, records, shapes, types, ms)
        finally:
            write(os.path.join(args.out, f"quantized_matmul_id-{tag}.json"), run, records, command)
    if "block" in modes:
        ms = (
            [int(v) for v in args.block_ms.split(",")]
            if args.block_ms
            else (SMOKE_BLOCK_MS if args.smoke else BLOCK_MS)
        )
        records = []
        try:
            block_mode(run, records, ms)
        finally:
            write(os.path.join(args.out, f"moe_block-{tag}.json"), run, records, command)
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
