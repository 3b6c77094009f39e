"""routemm's CPU backend beside ggml's CPU backend (llama.cpp), in one run, with the machine's read
bandwidth measured beside them.

Cases: Q4_0 4096 x 14336 (N x K) at m = 1, 8, 64, 512 (quantized_matmul_ggml: its default exact
route and, with --routes naming int8_dot, the reduced-precision int8-dot route of
GgmlRoutingPolicy.dense_int8_dot, the arithmetic ggml's CPU backend uses) and the Qwen3-30B-A3B
expert projection (128 experts of 768 x 2048, top-8) with bf16 and f32 weights
at m = 1, 64, 512 (dense_matmul_id: direct and grouped_prefill and, with --routes naming bf16_dot,
the reduced-precision direct_bf16_dot and grouped_bf16_dot for bf16 weights). Both sides run on the same number of threads
(ROUTEMM_CPU_THREADS for routemm, ggml_backend_cpu_set_n_threads for ggml) and report the minimum of
--runs timed batches: ggml's per-node time of a graph, routemm's time per dispatch of BATCH
dispatches in one submission (and, at m = 1, of a lone commit-and-wait as well); with --rounds R both sides are timed R times in alternation and each side's
minimum over the rounds is compared, so a drift of the machine's bandwidth during the run reaches
both (one-token cases on a shared VM move by 20-40 % between runs); the table also gives the median
and range of the per-round ratios, each from two sides measured minutes apart at most, and --ms 1
keeps only the one-token cases so a round lasts about a minute. Weights are cycled through copies (Q4_0: >= 128 MB in all; expert ids: fresh
random ids every call), so no call finds its weights in the last-level cache. The quantized_expert_id
case is the same expert projection with Q4_0 and Q8_0 expert stacks (quantized_matmul_id_ggml,
direct and grouped and, with --routes naming int8_dot, direct_int8_dot and grouped_int8_dot, beside
ggml's MUL_MAT_ID of the same types).

ggml comes from bench/peer/build_ggml_peer.sh SRC BUILD cpu (its ggml_mul_mat_peer binary; pass one
--peer per build, e.g. the plain Q4_0 layout and a GGML_CPU_REPACK=ON build, and the best of them is
ggml's time). ggml's own read-bandwidth probe (--read-bandwidth-mb) gives the bandwidth ceiling.

    python bench/cpu_peer.py --peer plain=.dev/peer-cpu/bin/ggml_mul_mat_peer \\
        --peer repack=.dev/peer-cpu-repack/bin/ggml_mul_mat_peer --routes exact,int8_dot,bf16_dot \\
        --rounds 3 --out bench/results/cpu_peer-cpu.json

The side-by-side table compares ggml with routemm's best exact route and, in rows of their own, with
its best reduced-precision route (rows marked "int8_dot" / "bf16_dot"); the routemm routes of one
case run back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

N, K = 4096, 14336
Q4_MS = Q4_MS_ALL = (1, 8, 64, 512)
E, TOP_K, EN, EK = 128, 8, 768, 2048
MOE_MS = MOE_MS_ALL = (1, 64, 512)
MOE_TYPES = ("bf16", "f32")
# --routes: the exact routes (always timed), the opt-in int8-dot routes (the Q4_0 product's and the
# quantised expert stacks') and the opt-in bf16-dot expert-ID routes (bf16 weights; timed where the
# CPU has AVX512_BF16).
ROUTES = ("exact", "int8_dot", "bf16_dot")
QMOE_TYPES = ("q4_0", "q8_0")
# --qmoe-types: the quantised expert stacks the quantized_expert_id case may time (Q4_K and Q6_K as
# Qwen3-30B-A3B's Q4_K_M GGUF holds them; the K-quants' int8-dot routes quantise activations per
# 256 values as ggml's Q8_K does).
QMOE_TYPES_ALL = ("q4_0", "q8_0", "q4_k", "q5_k", "q6_k")
CASES = ("q4_0", "expert_id", "quantized_expert_id")  # --cases
# Dispatches per timed submission, each with its own weights copy (Q4_0) or fresh ids (expert-ID):
# routemm's time per dispatch is then what ggml's per-node time of a graph of the same length is,
# with the threads kept busy from one dispatch to the next. At m = 1 a lone commit-and-wait (one
# dispatch per submission) is timed as well, as the one-call latency.
BATCH = 4


def _min_time(run, runs: int, setup=None) -> float:
    """Minimum wall time of `runs` calls of run(*setup()) after one warm-up call."""
    best = float("inf")
    for i in range(runs + 1):
        args = setup() if setup else ()
        t0 = time.perf_counter()
        run(*args)
        elapsed = time.perf_counter() - t0
        if i:
            best = min(best, elapsed)
    return best


def _protocol(batch: int) -> str:
    return f"per dispatch of {batch} in one submission" if batch > 1 else "one dispatch per commit-and-wait"


def _routemm_q4(routemm, device, registry, runs: int, routes: list[str]) -> list[dict]:
    from routemm import q4_0

    rng = np.random.default_rng(0)
    blocks = q4_0.quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.02)
    copies = [device.from_numpy(blocks) for _ in range(4)]  # 4 x 33 MB: more than the L3
    policies = {
        "exact": routemm.GgmlRoutingPolicy(),
        "int8_dot": routemm.GgmlRoutingPolicy(dense_int8_dot=True),
    }
    records = []
    for m in Q4_MS:
        x = device.from_numpy(rng.standard_normal((m, K), dtype=np.float32))
        out = device.alloc(m * N * 4, routemm.DType.F32, [m, N])
        params = routemm.GgmlQuantizedMatmulParams(m, N, K)
        for name in sorted((r for r in routes if r in policies), key=lambda r: r != "int8_dot"):
            turn = iter(range(10**9))
            receipt = {}

            def run(*weights, x=x, out=out, params=params, policy=policies[name]):
                encoder = device.command_encoder()
                for weight in weights:
                    receipt["r"] = routemm.quantized_matmul_ggml(encoder, registry, x, weight, out, params, policy)
                encoder.commit_and_wait()

            for batch in (BATCH, 1) if m == 1 else (BATCH,):
                seconds = _min_time(
                    run, runs, lambda turn=turn, batch=batch: [copies[next(turn) % len(copies)] for _ in range(batch)]
                )
                seconds /= batch
                weight_bytes = blocks.nbytes
                records.append(
                    dict(
                        op="q4_0_matmul",
                        shape=f"{N}x{K}",
                        m=m,
                        weight_dtype="q4_0",
                        route=receipt["r"].route,
                        precision=name,
                        impl="routemm",
                        protocol=_protocol(batch),
                        time_us=seconds * 1e6,
                        bytes=weight_bytes,
                        flops=2 * m * N * K,
                        TBps=weight_bytes / seconds / 1e12,
                        TFLOPs=2 * m * N * K / seconds / 1e12,
                    )
                )
                print(f"routemm q4_0 m={m} x{batch}: {seconds * 1e6:.0f} us ({receipt['r'].route})", flush=True)
    return records


def _time_expert_routes(routemm, device, runs: int, rng, op: str, dtype: str, stride: int, routes_for, encode):
    """Records of the expert-ID op `op` on one expert stack (`stride` bytes per expert) at every m
    of MOE_MS: for each (route, precision, params) of routes_for(m), the minimum time of `runs`
    calls of encode(encoder, x, ids, out, scratch, params), fresh random ids each call."""
    records = []
    for m in MOE_MS:
        x = device.from_numpy(rng.standard_normal((m, EK), dtype=np.float32))
        out = device.alloc(m * TOP_K * EN * 4, routemm.DType.F32, [m * TOP_K, EN])
        id_sets = [
            np.argsort(rng.random((m, E)), axis=1)[:, :TOP_K].astype(np.uint32) for _ in range((runs + 1) * BATCH)
        ]
        touched = np.mean([len(np.unique(ids)) for ids in id_sets]) * stride
        id_bufs = [device.from_numpy(ids) for ids in id_sets]
        for route, precision, params in routes_for(m):
            # One scratch per dispatch of a batch: the grouped routes' maps stay their own.
            scratches = [routemm.DenseMatmulIdScratch(device, E, m) if route.is_grouped else None for _ in range(BATCH)]
            turn = iter(range(10**9))

            def run(*ids, params=params, scratches=scratches, x=x, out=out):
                encoder = device.command_encoder()
                for one, scratch in zip(ids, scratches, strict=False):
                    encode(encoder, x, one, out, scratch, params)
                encoder.commit_and_wait()

            for batch in (BATCH, 1) if m == 1 else (BATCH,):
                seconds = _min_time(
                    run, runs, lambda turn=turn, batch=batch: [id_bufs[next(turn) % len(id_bufs)] for _ in range(batch)]
                )
                seconds /= batch
                flops = 2 * m * TOP_K * EN * EK
                records.append(
                    dict(
                        op=op,
                        shape="qwen3-30b-a3b",
                        m=m,
                        weight_dtype=dtype,
                        route=route.value,
                        precision=precision,
                        impl="routemm",
                        protocol=_protocol(batch),
                        time_us=seconds * 1e6,
                        bytes=float(touched),
                        flops=flops,
                        TBps=touched / seconds / 1e12,
                        TFLOPs=flops / seconds / 1e12,
                    )
                )
                print(f"routemm {op} {dtype} m={m} {route.value} x{batch}: {seconds * 1e6:.0f} us", flush=True)
    return records


def _routemm_expert_id(routemm, device, registry, runs: int, routes: list[str]) -> list[dict]:
    import ml_dtypes
    from routemm.dense_matmul_id import BF16_DOT_PIPELINE_NAMES

    bf16_dot = "bf16_dot" in routes and all(registry.has_kernel(n) for n in BF16_DOT_PIPELINE_NAMES)
    if "bf16_dot" in routes and not bf16_dot:
        print("bf16_dot routes not timed: this CPU backend has no AVX512_BF16 pipelines", flush=True)
    Route = routemm.DenseMatmulIdRoute
    dtypes = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
    records = []
    for name in MOE_TYPES:
        rng = np.random.default_rng(1)
        weights = (rng.standard_normal((E, EN, EK), dtype=np.float32) * 0.02).astype(dtypes[name])
        w_buf = device.from_numpy(weights)
        stride = EN * EK * weights.itemsize
        del weights
        routes_set = [(Route.DIRECT, "exact"), (Route.GROUPED_PREFILL, "exact")]
        if bf16_dot and name == "bf16":
            routes_set += [(Route.DIRECT_BF16_DOT, "bf16_dot"), (Route.GROUPED_BF16_DOT, "bf16_dot")]

        def routes_for(m, stride=stride, routes_set=routes_set):
            return [(r, p, routemm.DenseMatmulIdParams(m, EN, EK, TOP_K, E, stride, route=r)) for r, p in routes_set]

        def encode(encoder, x, ids, out, scratch, params, w_buf=w_buf):
            routemm.dense_matmul_id(encoder, registry, w_buf, x, ids, out, scratch, params)

        records += _time_expert_routes(routemm, device, runs, rng, "dense_matmul_id", name, stride, routes_for, encode)
        del w_buf
    return records


def _routemm_quantized_expert_id(routemm, device, registry, runs: int, routes: list[str]) -> list[dict]:
    from routemm import q4_0, q8_0
    from routemm.formats import ggml

    class _KQuant:
        def __init__(self, name):
            self.name = name

        def quantize(self, x):
            return ggml.quantize(x, self.name)

    codecs = {"q4_0": (q4_0, routemm.GgmlType.Q4_0), "q8_0": (q8_0, routemm.GgmlType.Q8_0)}
    codecs.update({t: (_KQuant(t), routemm.GgmlType(t)) for t in ("q4_k", "q5_k", "q6_k")})
    Route = routemm.GgmlQuantizedMatmulIdRoute
    records = []
    for name in QMOE_TYPES:
        codec, ggml_type = codecs[name]
        rng = np.random.default_rng(2)
        # Quantised one expert at a time: no float32 copy of the whole stack.
        blocks = np.stack([codec.quantize(rng.standard_normal((EN, EK), dtype=np.float32) * 0.02) for _ in range(E)])
        w_buf = device.from_numpy(blocks)
        stride = blocks[0].nbytes
        del blocks

        routes_set = [(Route.DIRECT, "exact"), (Route.GROUPED, "exact")]
        if "int8_dot" in routes:
            routes_set += [(Route.DIRECT_INT8_DOT, "int8_dot"), (Route.GROUPED_INT8_DOT, "int8_dot")]

        def routes_for(m, stride=stride, ggml_type=ggml_type, routes_set=routes_set):
            return [
                (r, p, routemm.GgmlQuantizedMatmulIdParams(m, EN, EK, TOP_K, E, ggml_type, stride, route=r))
                for r, p in routes_set
            ]

        def encode(encoder, x, ids, out, scratch, params, w_buf=w_buf):
            routemm.quantized_matmul_id_ggml(encoder, registry, x, w_buf, ids, out, scratch, params)

        records += _time_expert_routes(
            routemm, device, runs, rng, "quantized_matmul_id", name, stride, routes_for, encode
        )
        del w_buf
    return records


def _ggml(
    label: str, binary: str, threads: int, runs: int, bandwidth: bool, cases: list[str]
) -> tuple[list[dict], float | None]:
    """ggml's records (rotated weights, minimum of `runs` batches of one compute per node) for
    `cases` and, when asked, its read-bandwidth probe in GB/s."""
    common = [binary, "--backend", "cpu", "--threads", str(threads), "--modes", "rotated", "--stat", "min"]
    common += ["--batches", str(runs), "--reps", "1", "--warmup", "1", "--nodes", "2", "--rotate-mb", "128"]
    runs_args = {
        "q4_0": ["--only", "mul_mat", "--shapes", f"{N}x{K}", "--ms", ",".join(map(str, Q4_MS))],
        "expert_id": [
            "--only",
            "mul_mat_id",
            "--moe-types",
            ",".join(MOE_TYPES),
            "--moe-ms",
            ",".join(map(str, MOE_MS)),
        ],
        "quantized_expert_id": [
            "--only",
            "mul_mat_id",
            "--moe-types",
            ",".join(t.replace("_k", "_K") for t in QMOE_TYPES),  # ggml's type names
            "--moe-ms",
            ",".join(map(str, MOE_MS)),
        ],
    }
    ms_of = {"q4_0": Q4_MS, "expert_id": MOE_MS, "quantized_expert_id": MOE_MS}
    runs_args = [runs_args[case] for case in CASES if case in cases and ms_of[case]]
    records, gbps = [], None
    for i, extra in enumerate(runs_args):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "peer.json")
            probe = ["--read-bandwidth-mb", "512"] if bandwidth and i == 0 else []
            done = subprocess.run(common + extra + probe + ["--json", path], capture_output=True, text=True)
            print(done.stdout, end="", flush=True)
            if done.returncode != 0:
                raise SystemExit(f"{binary} failed ({done.returncode}): {done.stderr[-2000:]}")
            for line in done.stdout.splitlines():
                if line.startswith("bandwidth read_gbps="):
                    gbps = float(line.split()[1].split("=")[1])
            with open(path) as f:
                peer = json.load(f)
        for r in peer:
            r["type"] = r["type"].lower()  # q4_K -> q4_k, routemm's names
            moe = r["op"] == "MUL_MAT_ID"
            op = ("quantized_matmul_id" if r["type"] in QMOE_TYPES else "dense_matmul_id") if moe else "q4_0_matmul"
            flops = 2 * r["m"] * r["n"] * r["k"] * (r["top_k"] if moe else 1)
            seconds = r["us"] * 1e-6
            records.append(
                dict(
                    op=op,
                    shape="qwen3-30b-a3b" if moe else f"{r['n']}x{r['k']}",
                    m=r["m"],
                    weight_dtype=r["type"],
                    route=f"ggml_{label}",
                    impl="ggml_cpu",
                    time_us=r["us"],
                    TBps=r["tbps"],
                    bytes=r["tbps"] * 1e12 * seconds,
                    flops=flops,
                    TFLOPs=flops / seconds / 1e12,
                    cpu_isa=r.get("cpu_isa", "unknown"),
                    note=f"{r['peer']}; {r.get('cpu_isa', 'unknown')}; rel_err {r['rel_err']:.1e}",
                )
            )
    return records, gbps


def _comparison(records: list[dict], protocol: str) -> list[str]:
    """Side-by-side table: per case, ggml's best layout beside routemm's best exact route and, in
    rows of their own, beside its best reduced-precision route (int8-dot, bf16-dot), routemm's
    times those of `protocol`."""
    best: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r["op"] not in ("q4_0_matmul", "dense_matmul_id", "quantized_matmul_id"):
            continue
        if r["impl"].startswith("routemm") and r.get("protocol") != protocol:
            continue
        key = (r["op"], r["weight_dtype"], r["m"])
        side = best.setdefault(key, {})
        impl = r["impl"] if r.get("precision", "exact") == "exact" else f"{r['impl']}/{r['precision']}"
        if impl not in side or r["time_us"] < side[impl]["time_us"]:
            side[impl] = r
    lines = [
        "| case | m | routemm (us) | route (clone) | ggml (us) | layout (build ISA) | routemm speed / ggml speed "
        "| per round: median (range) |",
        "|---|---:|---:|---|---:|---|---:|---:|",
    ]
    rows = []
    for (op, dtype, m), side in best.items():
        for ours_key in sorted(k for k in side if k.startswith("routemm")) or ["routemm"]:
            rows.append(
                (
                    (op != "q4_0_matmul", op == "quantized_matmul_id", ours_key != "routemm", dtype, m),
                    (op, dtype, m, side, ours_key),
                )
            )
    for _, (op, dtype, m, side, ours_key) in sorted(rows, key=lambda row: row[0]):
        ours, peer = side.get(ours_key), side.get("ggml_cpu")
        case = f"Q4_0 {N}x{K}" if op == "q4_0_matmul" else f"expert-ID Qwen3 {dtype}"
        ratio = f"{peer['time_us'] / ours['time_us']:.2f}x" if ours and peer else ""
        per_round = _per_round_ratios(records, protocol, op, dtype, m, ours) if ours and peer else []
        paired = (
            f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"
            if len(per_round) > 1
            else ""
        )
        lines.append(
            f"| {case} | {m} | {ours['time_us']:.0f} | {ours['route']} ({ours.get('cpu_isa', '?')}) | "
            f"{peer['time_us']:.0f} | {peer['route'].removeprefix('ggml_')} ({peer.get('cpu_isa', '?')}) | "
            f"{ratio} | {paired} |"
            if ours and peer
            else f"| {case} | {m} | | | | | | |"
        )
    return lines


def _per_round_ratios(records: list[dict], protocol: str, op: str, dtype: str, m: int, ours: dict) -> list[float]:
    """Per round, ggml's best layout over routemm's time on `ours`'s route: the two sides measured
    minutes apart at most, so a drift of the machine between rounds cancels out of each ratio."""
    ratios = []
    for rnd in sorted({r.get("round") for r in records if r.get("round") is not None}):
        same = [
            r for r in records if r.get("round") == rnd and r["op"] == op and r["weight_dtype"] == dtype and r["m"] == m
        ]
        peer = [r["time_us"] for r in same if r["impl"] == "ggml_cpu"]
        mine = [
            r["time_us"]
            for r in same
            if r["impl"] == ours["impl"] and r["route"] == ours["route"] and r.get("protocol") == protocol
        ]
        if peer and mine:
            ratios.append(min(peer) / min(mine))
    return ratios


def main() -> None:
    global QMOE_TYPES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", action="append", default=[], help="LABEL=PATH of a ggml_mul_mat_peer binary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="times to repeat both sides, alternating")
    parser.add_argument("--out", default="bench/results/cpu_peer-cpu.json")
    parser.add_argument("--note", default="", help="a line for the report (e.g. that the machine was shared)")
    parser.add_argument(
        "--routes", default="exact", help=f"comma list of routemm's route sets to time: {', '.join(ROUTES)}"
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of cases: {', '.join(CASES)}")
    parser.add_argument("--ms", default=None, help="comma list of token counts to keep (default: every m of each case)")
    parser.add_argument(
        "--qmoe-types",
        default=",".join(QMOE_TYPES),
        help=f"comma list of the quantized_expert_id case's stack types: {', '.join(QMOE_TYPES_ALL)}",
    )
    args = parser.parse_args()
    QMOE_TYPES = tuple(t.strip() for t in args.qmoe_types.split(",") if t.strip())
    if not QMOE_TYPES or any(t not in QMOE_TYPES_ALL for t in QMOE_TYPES):
        parser.error(f"--qmoe-types takes a comma list of {', '.join(QMOE_TYPES_ALL)}, got {args.qmoe_types!r}")
    if not args.peer:
        parser.error("at least one --peer LABEL=PATH is needed")
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not routes or any(r not in ROUTES for r in routes):
        parser.error(f"--routes takes a comma list of {', '.join(ROUTES)}, got {args.routes!r}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not cases or any(c not in CASES for c in cases):
        parser.error(f"--cases takes a comma list of {', '.join(CASES)}, got {args.cases!r}")

    if args.ms:
        keep = {int(v) for v in args.ms.split(",") if v.strip()}
        global Q4_MS, MOE_MS
        Q4_MS = tuple(m for m in Q4_MS if m in keep)
        MOE_MS = tuple(m for m in MOE_MS if m in keep)
        if not Q4_MS and not MOE_MS:
            parser.error(f"--ms keeps none of the cases' token counts ({sorted(set(Q4_MS_ALL) | set(MOE_MS_ALL))})")
    os.environ["ROUTEMM_CPU_THREADS"] = str(args.threads)  # read once, at the first kernel
    import routemm

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import conftest  # the results format: device name, git revision, Markdown table

    records, gbps = [], None
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    # Each round times every peer and then routemm; the comparison takes each side's minimum over
    # the rounds, so a drift of the machine's bandwidth during the run reaches both sides.
    for round_index in range(args.rounds):
        found = []
        for i, spec in enumerate(args.peer):
            label, _, path = spec.partition("=")
            probe_now = i == 0 and round_index == 0
            peer_records, probe = _ggml(label, path, args.threads, args.runs, bandwidth=probe_now, cases=cases)
            found += peer_records
            gbps = gbps if probe is None else probe
        if "q4_0" in cases:
            found += _routemm_q4(routemm, device, registry, args.runs, routes)
        if "expert_id" in cases:
            found += _routemm_expert_id(routemm, device, registry, args.runs, routes)
        if "quantized_expert_id" in cases:
            found += _routemm_quantized_expert_id(routemm, device, registry, args.runs, routes)
        records += [dict(r, round=round_index + 1) for r in found]
    # Every row names the CPU and the instruction set its kernels ran (ggml: the one its CPU
    # backend was built for; routemm: the clone ROUTEMM_CPU_ISA and the CPU left it).
    cpu = conftest._cpu_name()
    for r in records:
        r["cpu"] = cpu
        if r["impl"] == "routemm":
            r["cpu_isa"] = device.properties["isa"]
            r["note"] = f"clone {r['cpu_isa']}" + (f"; {r['note']}" if r.get("note") else "")

    doc = {
        "device": f"cpu: {cpu} ({os.cpu_count()} threads; {args.threads} used by each side; "
        f"routemm clone {device.properties['isa']})",
        "git_rev": conftest._git_rev(),
        "command": "python bench/cpu_peer.py " + " ".join(sys.argv[1:]),
        "ceilings": {"read_TBps": (gbps or 0.0) / 1e3},
        "records": records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    text = conftest._markdown(doc)
    text += "\n## routemm beside ggml (minimum of {} calls over {} round(s), {} threads each)\n\n".format(
        args.runs, args.rounds, args.threads
    )
    text += f"Read bandwidth ({args.threads} threads, 512 MB): {gbps:.1f} GB/s.\n\n" if gbps else ""
    text += (
        f"Method: routemm: minimum over the timed submissions of the wall time (encode, commit, wait) of "
        f"{BATCH} dispatches in one submission, divided by {BATCH}; weights cycled over copies or fresh ids "
        "per dispatch (the m = 1 latency of one dispatch per submission in the table after). ggml: "
        "ggml_mul_mat_peer in rotated mode, minimum over batches of one graph compute per node (per-node time; it includes ggml's activation quantisation), plain and "
        "repacked (GGML_CPU_REPACK=ON) Q4_0 layouts, the faster one taken.\n\n"
    )
    batched = _comparison(records, _protocol(BATCH))
    text += ("" if not args.note else args.note + "\n\n") + "\n".join(batched) + "\n"
    one_call = [line for line in _comparison(records, _protocol(1)) if not line.endswith("| | | | | |")]
    text += (
        "\n### One dispatch per commit-and-wait (m = 1)\n\n"
        "routemm's latency of a lone call (encode, commit, wait) beside the same ggml per-node times:\n\n"
        + "\n".join(one_call)
        + "\n"
    )
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(text)
    print("\n".join(batched))
    print("\n".join(one_call))


if __name__ == "__main__":
    main()
