"""CUDA benchmark of the expert-ID matmul against PyTorch peers, in one run on one GPU.

    python3 bench/bench_cuda_dense_matmul_id.py OUT.json [--quick]

Shapes: Qwen3-30B-A3B (E=128, top_k=8, n=768, k=2048), DeepSeek-V3 (E=256, top_k=8, n=2048,
k=7168), Mixtral-8x7B (E=8, top_k=2, n=14336, k=4096); m in {1, 8, 32, 128, 512, 4096}; bf16 and
f32 weights; routemm direct and grouped_prefill (router-like top-k ids are always distinct).
Peers in the same process: the Hugging Face per-expert loop (torch_loop), torch._grouped_mm in bf16
with the gather and activation conversion included (bf16 weights only), and gather + bmm (m <= 8).

Timing: CUDA events (routemm: commit_wait_with_gpu_time around N back-to-back calls in one
encoder), warm-up first, median over several batches; every call uses fresh router ids and the
weight stacks rotate among copies totalling > 200 MB, so decode is not served from L2.
Bytes = the experts actually touched + activations + output; FLOPs = 2 m top_k n k.
Writes OUT.json (the results format of DESIGN.md) and OUT.md (a table).
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
import torch

SHAPES = {
    "qwen3-30b-a3b": dict(E=128, top_k=8, n=768, k=2048),
    "deepseek-v3": dict(E=256, top_k=8, n=2048, k=7168),
    "mixtral-8x7b": dict(E=8, top_k=2, n=14336, k=4096),
}
MS = [1, 8, 32, 128, 512, 4096]
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
CEILINGS = {"copy_TBps": 4.17, "bf16_TFLOPs": 794, "tf32_TFLOPs": 414, "fp32_TFLOPs": 51}
TARGET_S = 0.12  # device time per measurement batch set
ID_SETS = 16


def log(*a):
    print(*a, flush=True)
    sys.stdout.flush()


def router_ids(gen, m, E, top_k, device="cuda"):
    """Router-like expert ids int32 [m, top_k]: the top-k of random scores, distinct per token."""
    scores = torch.rand((m, E), generator=gen, device=device)
    return torch.topk(scores, top_k, dim=1).indices.to(torch.int32)


def to_routemm(t: torch.Tensor, device):
    t = t.contiguous()
    try:
        buf = routemm.from_dlpack(t)
        if t.dtype == torch.int32:  # expert ids: the same bits as U32
            buf = buf.view(0, buf.nbytes, routemm.DType.U32, list(t.shape))
        return buf
    except Exception as exc:  # fall back to a host round trip
        log(f"   from_dlpack failed ({type(exc).__name__}: {str(exc)[:120]}); copying through the host")
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.uint16).cpu().numpy()
            return device.from_numpy(arr, routemm.DType.BF16)
        if t.dtype == torch.int32:
            return device.from_numpy(t.cpu().numpy().view(np.uint32))
        return device.from_numpy(t.cpu().numpy())


def time_torch(fn, n_calls, batches=5):
    """Median per-call time (s) of fn(i) over `batches` batches of n_calls, CUDA events."""
    fn(0)
    torch.cuda.synchronize()
    samples = []
    for b in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n_calls):
            fn(b * n_calls + i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n_calls)
    return statistics.median(samples)


def gpu_events(fn, n_calls) -> list:
    """The CUPTI trace events (torch.profiler, Chrome trace format) of fn(1) .. fn(n_calls), after
    an untraced warm-up fn(0)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n_calls):
            fn(i + 1)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_time(fn, n_calls, per_call_kernels=None):
    """Device busy time per call (s) from CUPTI kernel records (torch.profiler), excluding host
    launch gaps: with per_call_kernels, the median over calls of the summed kernel durations of
    each call; otherwise total kernel + memcpy/memset time divided by n_calls. None if unavailable."""
    evs = gpu_events(fn, n_calls)
    gpu = sorted(
        (e for e in evs if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    if not gpu:
        return None
    if per_call_kernels:
        ks = [e["dur"] for e in gpu if e.get("cat") == "kernel"]
        if len(ks) != n_calls * per_call_kernels:
            return sum(ks) / 1e6 / n_calls
        per = [sum(ks[i * per_call_kernels : (i + 1) * per_call_kernels]) for i in range(n_calls)]
        return statistics.median(per) / 1e6
    return sum(e["dur"] for e in gpu) / 1e6 / n_calls


def calls_for(estimate_s, lo=1, hi=200):
    return int(max(lo, min(hi, TARGET_S / 5 / max(estimate_s, 1e-7))))


def run_shape(name, cfg, dtype_name, ms, device, registry, records, quick, only_routes=None, peer_names=None):
    E, top_k, n, k = cfg["E"], cfg["top_k"], cfg["n"], cfg["k"]
    tdtype = DTYPES[dtype_name]
    esize = torch.tensor([], dtype=tdtype).element_size()
    stack_bytes = E * n * k * esize
    copies = max(1, math.ceil(400e6 / stack_bytes))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    stacks = [(torch.randn((E, n, k), device="cuda", generator=gen) * 0.02).to(tdtype) for _ in range(copies)]
    w_bufs = [to_routemm(s, device) for s in stacks]
    for m in ms:
        x = torch.randn((m, k), device="cuda", generator=gen)
        x_buf = to_routemm(x, device)
        ids_list = [router_ids(gen, m, E, top_k) for _ in range(ID_SETS)]
        id_bufs = [to_routemm(i, device) for i in ids_list]
        out = torch.empty((m * top_k, n), device="cuda")
        out_buf = to_routemm(out, device)
        scratch = routemm.DenseMatmulIdScratch(device, E, m)
        flops = 2 * m * top_k * n * k

        def nbytes(ids):
            touched = int(torch.unique(ids).numel())
            return touched * n * k * esize + m * k * 4 + m * top_k * n * 4

        avg_bytes = statistics.mean(nbytes(i) for i in ids_list[:4])

        def add(route, impl, t, note="", wall=None):
            rec = dict(
                op="dense_matmul_id",
                shape=name,
                m=m,
                weight_dtype=dtype_name,
                route=route,
                impl=impl,
                time_us=t * 1e6,
                bytes=int(avg_bytes),
                flops=flops,
                TBps=avg_bytes / t / 1e12,
                TFLOPs=flops / t / 1e12,
            )
            if wall is not None:
                rec["wall_us"] = wall * 1e6
            if note:
                rec["note"] = note
            records.append(rec)
            log(
                f"{name:14s} {dtype_name:4s} m={m:5d} {route:16s} {impl:17s} {t * 1e6:11.1f} us "
                f"{avg_bytes / t / 1e12:6.3f} TB/s {flops / t / 1e12:7.2f} TFLOP/s {note}"
            )

        def add_failure(route, note):
            """A routemm result that failed its check: recorded without a time."""
            records.append(
                dict(
                    op="dense_matmul_id",
                    shape=name,
                    m=m,
                    weight_dtype=dtype_name,
                    route=route,
                    impl="routemm",
                    time_us=float("nan"),
                    note=note,
                )
            )

        # ---- routemm, both routes; correctness and bit identity on the first id set ----
        ref = None
        outs = {}
        routes = ["direct", "grouped_prefill"]
        if m >= 8:  # the opt-in tensor-core routes: from a few rows per expert on (decode batches too)
            routes += ["grouped_tensor_tf32"] + (["grouped_tensor_lowp"] if dtype_name != "f32" else [])
        if only_routes is not None:
            routes = [r for r in routes if r in only_routes]
        for route in routes:
            params = routemm.DenseMatmulIdParams(
                m, n, k, top_k, E, n * k * esize, route=routemm.DenseMatmulIdRoute(route)
            )
            enc = device.command_encoder()
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            routemm.dense_matmul_id(enc, registry, w_bufs[0], x_buf, id_bufs[0], out_buf, scratch, params)
            enc.commit_and_wait()
            outs[route] = out.clone()
            if ref is None:  # float32 reference on up to 64 sampled rows
                total = m * top_k
                rows = torch.arange(0, total, max(1, total // 64), device="cuda")[:64]
                wsel = stacks[0][ids_list[0].reshape(-1).long()[rows]].float()
                ref = (rows, torch.einsum("snk,sk->sn", wsel, x[rows // top_k]))
                del wsel
            got = outs[route]
            rows, want = ref
            got_s = got[rows]
            err = (got_s - want).norm() / want.norm()
            tolerance = {"grouped_tensor_tf32": 2e-3, "grouped_tensor_lowp": 1e-2}.get(route, 1e-4)
            if not torch.isfinite(got).all() or err > tolerance:
                log(f"!! {name} {dtype_name} m={m} {route}: relative error {err:.3e} (or non-finite)")
                add_failure(route, f"WRONG rel err {float(err):.3e}")
                continue

            # one timed call to size the batches
            enc = device.command_encoder()
            routemm.dense_matmul_id(enc, registry, w_bufs[0], x_buf, id_bufs[1], out_buf, scratch, params)
            est = enc.commit_wait_with_gpu_time()
            est_s = est[1] - est[0]
            n_calls = calls_for(est_s, hi=200 if not quick else 20)
            samples = []
            for b in range(5):
                enc = device.command_encoder()
                for i in range(n_calls):
                    j = b * n_calls + i
                    routemm.dense_matmul_id(
                        enc, registry, w_bufs[j % copies], x_buf, id_bufs[j % ID_SETS], out_buf, scratch, params
                    )
                g = enc.commit_wait_with_gpu_time()
                samples.append((g[1] - g[0]) / n_calls)
            wall = statistics.median(samples)

            def one_call(j, params=params):
                enc = device.command_encoder()
                routemm.dense_matmul_id(
                    enc, registry, w_bufs[j % copies], x_buf, id_bufs[j % ID_SETS], out_buf, scratch, params
                )
                enc.commit_and_wait()

            try:
                kt = kernel_time(one_call, min(n_calls, 40), per_call_kernels=1 if route == "direct" else 2)
            except Exception as exc:  # noqa: BLE001
                log(f"   profiler unavailable: {exc}")
                kt = None
            if kt is None:
                add(route, "routemm", wall, note="event time incl. host launch gaps")
            else:
                add(route, "routemm", kt, wall=wall, note="kernel time (CUPTI)")
        if "direct" in outs and "grouped_prefill" in outs:
            same = torch.equal(outs["direct"].view(torch.int32), outs["grouped_prefill"].view(torch.int32))
            if not same:
                log(f"!! {name} {dtype_name} m={m}: direct and grouped_prefill differ bitwise")
                add_failure("grouped_prefill", "NOT bit-identical to direct")

        # ---- peers ----
        def torch_loop(i):  # Hugging Face formulation (Mixtral/Qwen-MoE sparse block)
            w = stacks[i % copies]
            ids = ids_list[i % ID_SETS].long()
            res = torch.zeros((m * top_k, n), device="cuda")
            mask = torch.nn.functional.one_hot(ids, num_classes=E).permute(2, 1, 0)  # [E, top_k, m]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit.view(-1).tolist():
                idx, top_x = torch.where(mask[e])
                cur = x[top_x].to(w.dtype)
                res[top_x * top_k + idx] = (cur @ w[e].T).float()
            return res

        def grouped_mm(i):  # sort by expert, gather + convert, one grouped GEMM, scatter back
            w = stacks[i % copies]
            flat = ids_list[i % ID_SETS].reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            a = x[order // top_k].to(torch.bfloat16)
            res = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
            out2 = torch.empty((m * top_k, n), device="cuda")
            out2[order] = res.float()
            return out2

        def gather_bmm(i):
            w = stacks[i % copies]
            flat = ids_list[i % ID_SETS].reshape(-1).long()
            ws = w[flat]  # [m*top_k, n, k]
            xs = x.repeat_interleave(top_k, 0).to(w.dtype).unsqueeze(-1)
            return torch.bmm(ws, xs).squeeze(-1).float()

        peers = [("torch_loop", torch_loop)]
        if dtype_name == "bf16" and hasattr(torch, "_grouped_mm"):
            peers.append(("torch_grouped_mm", grouped_mm))
        if m <= 8:
            peers.append(("torch_gather_bmm", gather_bmm))
        if peer_names is not None:
            peers = [(impl, fn) for impl, fn in peers if impl in peer_names]
        for impl, fn in peers:
            try:
                t0 = time.perf_counter()
                fn(0)
                torch.cuda.synchronize()
                est = time.perf_counter() - t0
                calls = calls_for(est, hi=100 if not quick else 10)
                t = time_torch(fn, calls, batches=3 if impl == "torch_loop" else 5)
                route_name = "per_expert_loop" if impl == "torch_loop" else impl.replace("torch_", "")
                kt = None
                if impl != "torch_loop":  # the HF loop is launch-bound by design: its event time is its cost
                    try:
                        kt = kernel_time(fn, min(calls, 20))
                    except Exception as exc:  # noqa: BLE001
                        log(f"   profiler unavailable: {exc}")
                if kt is None:
                    add(route_name, impl, t, note="event time incl. host gaps")
                else:
                    add(route_name, impl, kt, wall=t, note="kernel time (CUPTI)")
            except Exception as exc:  # noqa: BLE001 - a missing peer is recorded, not fatal
                log(f"   peer {impl} unavailable: {type(exc).__name__}: {str(exc)[:200]}")
        del x_buf, id_bufs, out_buf, scratch
    del w_bufs, stacks
    torch.cuda.empty_cache()


def table(doc):
    lines = [
        f"# dense_matmul_id on {doc['device']} (git {doc['git_rev']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        "Ceilings: copy 4.17 TB/s, fp32 (no tensor cores) 51 TFLOP/s, bf16 794 TFLOP/s. "
        "frac = achieved / ceiling (TB/s vs copy for m <= 8; beyond, TFLOP/s vs fp32 for scalar routes, tf32 414 for grouped_tensor_tf32, bf16 for grouped_tensor_lowp and torch._grouped_mm).",
        "",
        "time = device kernel time per call (CUPTI) where measured; wall = CUDA-event time per call over "
        "back-to-back calls, including host launch gaps.",
        "",
        "| shape | dtype | m | route | impl | time (us) | wall (us) | TB/s | TFLOP/s | frac | vs routemm direct |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {}
    for r in doc["records"]:
        if r["impl"] == "routemm" and r["route"] == "direct" and r.get("time_us") == r.get("time_us"):
            base[(r["shape"], r["weight_dtype"], r["m"])] = r["time_us"]
    for r in doc["records"]:
        t = r.get("time_us", float("nan"))
        if t != t:
            lines.append(
                f"| {r['shape']} | {r['weight_dtype']} | {r['m']} | {r['route']} | {r['impl']} | "
                f"n/a | | | | | {r.get('note', '')} |"
            )
            continue
        compute_ceiling = {
            "grouped_tensor_tf32": CEILINGS.get("tf32_TFLOPs", 414),
            "grouped_tensor_lowp": CEILINGS["bf16_TFLOPs"],
            "grouped_mm": CEILINGS["bf16_TFLOPs"],
        }.get(r["route"], CEILINGS["fp32_TFLOPs"])
        frac = (r["TBps"] / CEILINGS["copy_TBps"]) if r["m"] <= 8 else (r["TFLOPs"] / compute_ceiling)
        b = base.get((r["shape"], r["weight_dtype"], r["m"]))
        lines.append(
            f"| {r['shape']} | {r['weight_dtype']} | {r['m']} | {r['route']} | {r['impl']} | {t:.1f} | "
            f"{r.get('wall_us', t):.1f} | {r['TBps']:.3f} | {r['TFLOPs']:.2f} | {frac:.2f} | {b / t if b else float('nan'):.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true", help="fewer calls per batch")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--routes", default=None, help="comma list of routemm routes to run (default: all)")
    ap.add_argument(
        "--peers", default=None, help="comma list of peers (torch_loop, torch_grouped_mm, torch_gather_bmm); 'none'"
    )
    args = ap.parse_args()
    device = routemm.Device("cuda")
    registry = routemm.KernelRegistry(device)
    records = []
    t0 = time.time()
    doc = {
        "device": torch.cuda.get_device_name(0),
        "git_rev": os.environ.get("GIT_REV", "unknown"),
        "command": os.environ.get("BENCH_COMMAND", " ".join(["python3"] + sys.argv)),
        "ceilings": CEILINGS,
        "torch": torch.__version__,
        "records": records,
    }

    def save():  # after every shape, so a timeout still leaves results
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        md = table(doc)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md)
        return md

    for name in args.shapes.split(","):
        for dt in args.dtypes.split(","):
            run_shape(
                name,
                SHAPES[name],
                dt,
                [int(v) for v in args.ms.split(",")],
                device,
                registry,
                records,
                args.quick,
                only_routes=None if args.routes is None else set(args.routes.split(",")),
                peer_names=None if args.peers is None else set(args.peers.split(",")),
            )
            log(f"-- {name} {dt} done at {time.time() - t0:.0f} s")
            save()
    print(save())


if __name__ == "__main__":
    main()
