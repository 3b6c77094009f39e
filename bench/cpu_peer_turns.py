"""routemm and ggml's CPU backend on the one-token cases, taking turns batch by batch.

bench/cpu_peer.py times each side for a while before the other, so where the machine's memory
bandwidth drifts (a VM's can move between 33 and 57 GB/s within minutes) a ratio of minima can
reflect which side met a fast phase. Here both sides stay alive: every peer build runs with
--serve (bench/peer/ggml_mul_mat_peer.cpp), holding one case set up, and each round times routemm
(minimum of 5 submissions of 4 dispatches, per dispatch, the cpu_peer.py protocol), then each peer
(minimum of 3 graph computes, per node), in an order that rotates round by round. A round of a
case lasts tens of milliseconds, so both sides see the same bandwidth.

Cases (m = 1): Q4_0 4096 x 14336 (quantized_matmul_ggml, exact mat-vec and int8-dot), the
Qwen3-30B-A3B experts (128 x 768 x 2048, top-8) as bf16 (dense_matmul_id direct and
direct_bf16_dot where the CPU has AVX512_BF16), f32 (direct), Q4_0 and Q8_0 (quantized_matmul_id_ggml
direct and direct_int8_dot). Per case: each side's minimum and median over the rounds, and the median of the per-round
ratios (routemm's speed over the best peer's in that round). Writes DESIGN.md's results JSON and
Markdown with --out.

    python bench/cpu_peer_turns.py --peer plain=.dev/peer-cpu/bin/ggml_mul_mat_peer \\
        --peer repack=.dev/peer-cpu-repack/bin/ggml_mul_mat_peer --rounds 30 \\
        --out bench/results/cpu_peer_turns-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

N, K = 4096, 14336
E, TOP_K, EN, EK = 128, 8, 768, 2048
BATCH, SUBMISSIONS = 4, 5
# Peer cases in the order the harness serves them (its build_cases: MUL_MAT first, then
# MUL_MAT_ID by type as --moe-types lists them), keyed (op, ggml type).
PEER_TYPES = ("bf16", "f32", "q4_0", "q8_0")


def routemm_cases(routemm):
    """{(op, type): [(route label, run(batch))]} of every one-token case, set up once."""
    import ml_dtypes
    from routemm import q4_0, q8_0
    from routemm.dense_matmul_id import BF16_DOT_PIPELINE_NAMES

    dev = routemm.Device("cpu")
    reg = routemm.KernelRegistry(dev)
    rng = np.random.default_rng(1)
    turn = iter(range(10**9))
    cases: dict[tuple[str, str], list] = {}

    def batched(dispatch):
        """run(batch): `batch` calls of dispatch(encoder, turn number) in one submission."""

        def run(batch):
            enc = dev.command_encoder()
            for _ in range(batch):
                dispatch(enc, next(turn))
            enc.commit_and_wait()

        return run

    blocks = q4_0.quantize(rng.standard_normal((N, K), dtype=np.float32) * 0.02)
    copies = [dev.from_numpy(blocks) for _ in range(4)]  # 4 x 33 MB: more than the caches
    x = dev.from_numpy(rng.standard_normal((1, K), dtype=np.float32))
    out = dev.alloc(N * 4, routemm.DType.F32, [1, N])
    params = routemm.GgmlQuantizedMatmulParams(1, N, K)
    for label, policy in (
        ("exact", routemm.GgmlRoutingPolicy()),
        ("int8_dot", routemm.GgmlRoutingPolicy(dense_int8_dot=True)),
    ):
        run = batched(
            lambda enc, i, policy=policy: routemm.quantized_matmul_ggml(
                enc, reg, x, copies[i % len(copies)], out, params, policy
            )
        )
        cases.setdefault(("MUL_MAT", "q4_0"), []).append((label, run))

    xe = dev.from_numpy(rng.standard_normal((1, EK), dtype=np.float32))
    oe = dev.alloc(TOP_K * EN * 4, routemm.DType.F32, [TOP_K, EN])
    ids = [dev.from_numpy(np.argsort(rng.random((1, E)))[:, :TOP_K].astype(np.uint32)) for _ in range(64)]
    route = routemm.DenseMatmulIdRoute
    bf16_dot = all(reg.has_kernel(p) for p in BF16_DOT_PIPELINE_NAMES)
    for name, dtype, routes in (
        ("bf16", ml_dtypes.bfloat16, (route.DIRECT, route.DIRECT_BF16_DOT) if bf16_dot else (route.DIRECT,)),
        ("f32", np.float32, (route.DIRECT,)),
    ):
        w = dev.from_numpy((rng.standard_normal((E, EN, EK), dtype=np.float32) * 0.02).astype(dtype))
        stride = EN * EK * np.dtype(dtype).itemsize
        for r in routes:
            p = routemm.DenseMatmulIdParams(1, EN, EK, TOP_K, E, stride, route=r)
            run = batched(
                lambda enc, i, w=w, p=p: routemm.dense_matmul_id(enc, reg, w, xe, ids[i % len(ids)], oe, None, p)
            )
            cases.setdefault(("MUL_MAT_ID", name), []).append((r.value, run))

    for name, codec, ggml_type in (("q4_0", q4_0, routemm.GgmlType.Q4_0), ("q8_0", q8_0, routemm.GgmlType.Q8_0)):
        stack = np.stack([codec.quantize(rng.standard_normal((EN, EK), dtype=np.float32) * 0.02) for _ in range(E)])
        w = dev.from_numpy(stack)
        stride = stack[0].nbytes
        del stack
        for r in (routemm.GgmlQuantizedMatmulIdRoute.DIRECT, routemm.GgmlQuantizedMatmulIdRoute.DIRECT_INT8_DOT):
            p = routemm.GgmlQuantizedMatmulIdParams(1, EN, EK, TOP_K, E, ggml_type, stride, route=r)
            run = batched(
                lambda enc, i, w=w, p=p: routemm.quantized_matmul_id_ggml(
                    enc, reg, xe, w, ids[i % len(ids)], oe, None, p
                )
            )
            cases.setdefault(("MUL_MAT_ID", name), []).append((r.value, run))
    return cases


def time_routemm(run) -> float:
    """Per-dispatch microseconds: the fastest of SUBMISSIONS submissions of BATCH dispatches."""
    best = float("inf")
    for _ in range(SUBMISSIONS):
        t0 = time.perf_counter()
        run(BATCH)
        best = min(best, (time.perf_counter() - t0) / BATCH)
    return best * 1e6


class Peer:
    """One ggml_mul_mat_peer --serve process, serving the one-token cases in order."""

    def __init__(self, label: str, binary: str, threads: int):
        self.label = label
        args = [binary, "--backend", "cpu", "--threads", str(threads), "--serve", "--modes", "rotated"]
        args += [
            "--stat",
            "min",
            "--batches",
            "3",
            "--reps",
            "1",
            "--warmup",
            "1",
            "--nodes",
            "2",
            "--rotate-mb",
            "128",
        ]
        args += ["--shapes", f"{N}x{K}", "--ms", "1", "--moe-ms", "1", "--moe-types", ",".join(PEER_TYPES)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.header = self.proc.stdout.readline().strip()  # "# peer: ... on ..."

    def next_case(self) -> tuple[str, str] | None:
        """(op, type) of the case now served, None when the harness is done; result lines pass by."""
        for line in self.proc.stdout:
            if line.startswith("serve "):
                fields = dict(word.split("=", 1) for word in line.split()[1:])
                return fields["op"], fields["type"]
            print(f"{self.label}: {line.strip()}", flush=True)
        return None

    def time(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline().split("=")[1])

    def finish_case(self) -> None:
        self.proc.stdin.write("next\n")
        self.proc.stdin.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", action="append", required=True, help="LABEL=PATH of a ggml_mul_mat_peer build")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", help="results JSON (the Markdown beside it)")
    args = ap.parse_args()

    import routemm

    cases = routemm_cases(routemm)
    peers = [Peer(*spec.split("=", 1), args.threads) for spec in args.peer]
    records, table = [], []
    while True:
        served = [p.next_case() for p in peers]
        if served[0] is None:
            break
        assert all(s == served[0] for s in served), served
        key = served[0]
        runs = cases.get(key, [])
        for _, run in runs:
            run(BATCH)  # warm-up
        times: dict[str, list[float]] = {label: [] for label, _ in runs}
        times.update({p.label: [] for p in peers})
        sides = [(label, lambda run=run: time_routemm(run)) for label, run in runs] + [(p.label, p.time) for p in peers]
        for rnd in range(args.rounds):
            shift = rnd % len(sides)
            for label, timer in sides[shift:] + sides[:shift]:
                times[label].append(timer())
        for p in peers:
            p.finish_case()
        peer_best = [min(times[p.label][i] for p in peers) for i in range(args.rounds)]
        for label, _ in runs:
            ratios = [pb / t for pb, t in zip(peer_best, times[label], strict=True)]
            row = dict(
                op=key[0],
                weight_dtype=key[1],
                m=1,
                route=label,
                routemm_min_us=min(times[label]),
                routemm_median_us=statistics.median(times[label]),
                ggml_min_us=min(peer_best),
                ggml_median_us=statistics.median(peer_best),
                ratio_of_minima=min(peer_best) / min(times[label]),
                median_round_ratio=statistics.median(ratios),
                round_ratio_range=[min(ratios), max(ratios)],
                rounds=args.rounds,
            )
            table.append(row)
            print(
                f"{key[0]} {key[1]} {label}: routemm min {row['routemm_min_us']:.0f} median "
                f"{row['routemm_median_us']:.0f} us; ggml min {row['ggml_min_us']:.0f} median "
                f"{row['ggml_median_us']:.0f} us; ratio of minima {row['ratio_of_minima']:.2f}, "
                f"per round {row['median_round_ratio']:.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                flush=True,
            )
        for label in times:
            records += [
                dict(op=key[0], weight_dtype=key[1], m=1, side=label, round=i + 1, time_us=t)
                for i, t in enumerate(times[label])
            ]
    for p in peers:
        p.proc.wait()
    if args.out:
        _write(args, peers, table, records)


def _write(args, peers, table, records) -> None:
    rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python bench/cpu_peer_turns.py " + " ".join(sys.argv[1:])
    doc = dict(
        schema="routemm.bench.cpu_peer_turns/1",
        git_revision=rev,
        command=command,
        machine=platform.processor() or platform.machine(),
        threads=args.threads,
        peers={p.label: p.header for p in peers},
        cases=table,
        records=records,
    )
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    lines = [
        f"# routemm and ggml-CPU taking turns, one token ({args.threads} threads each) — {rev}",
        "",
        f"Command: `{command}`",
        "",
        "Peers: " + "; ".join(f"{p.label}: {p.header.lstrip('# ')}" for p in peers),
        "",
        "Each round times routemm (fastest of 5 submissions of 4 dispatches, per dispatch) and every peer "
        "(fastest of 3 graph computes, per node) back to back, in an order rotating round by round; ggml's "
        "time is its best build's in that round.",
        "",
        "| case | route | routemm min / median (us) | ggml min / median (us) | speed ratio of minima | per-round ratio: median (range) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in table:
        case = f"{'Q4_0 4096x14336' if r['op'] == 'MUL_MAT' else 'expert-ID Qwen3 ' + r['weight_dtype']}"
        lo, hi = r["round_ratio_range"]
        lines.append(
            f"| {case} | {r['route']} | {r['routemm_min_us']:.0f} / {r['routemm_median_us']:.0f} | "
            f"{r['ggml_min_us']:.0f} / {r['ggml_median_us']:.0f} | {r['ratio_of_minima']:.2f}x | "
            f"{r['median_round_ratio']:.2f}x ({lo:.2f}-{hi:.2f}) |"
        )
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
