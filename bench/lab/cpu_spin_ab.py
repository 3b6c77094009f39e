"""The CPU pool's polling (ROUTEMM_CPU_SPIN_US) against sleeping at once, as two live processes
timed in turn: one with the knob at its default, one with ROUTEMM_CPU_SPIN_US=0. Each child sets up
its cases once (the Qwen3-30B-A3B expert stacks, 128 x 768 x 2048, bf16 and f32; a Q4_0 4096 x 14336
weight and a 2048 x 2048 one), then on each round's request times every case (minimum of 12
submissions, per dispatch) and reports; the parent alternates which child goes first. The knob is
read once per process, so two processes are the only way to hold both settings at once; taking
turns round by round keeps the machine's drifting memory bandwidth out of the comparison.

    python bench/lab/cpu_spin_ab.py [ROUNDS]        # prints each round and the medians
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

E, EN, EK, TOP_K = 128, 768, 2048, 8
REPEATS = 12


def _cases(routemm):
    """(name, dispatches per submission, run(batch)) of every timed case."""
    import ml_dtypes
    from routemm import q4_0
    from routemm.dense_matmul_id import BF16_DOT_PIPELINE_NAMES

    dev = routemm.Device("cpu")
    reg = routemm.KernelRegistry(dev)
    route = routemm.DenseMatmulIdRoute
    rng = np.random.default_rng(1)
    cases = []
    x1 = dev.from_numpy(rng.standard_normal((1, EK), dtype=np.float32))
    out = dev.alloc(TOP_K * EN * 4, routemm.DType.F32, [TOP_K, EN])
    ids = [dev.from_numpy(np.argsort(rng.random((1, E)))[:, :TOP_K].astype(np.uint32)) for _ in range(64)]
    turn = iter(range(10**9))
    for name, dtype, routes in (
        ("bf16", ml_dtypes.bfloat16, (route.DIRECT, route.DIRECT_BF16_DOT)),
        ("f32", np.float32, (route.DIRECT,)),
    ):
        w = dev.from_numpy((rng.standard_normal((E, EN, EK), dtype=np.float32) * 0.02).astype(dtype))
        stride = EN * EK * np.dtype(dtype).itemsize
        for r in routes:
            if r is route.DIRECT_BF16_DOT and not all(reg.has_kernel(p) for p in BF16_DOT_PIPELINE_NAMES):
                continue
            params = routemm.DenseMatmulIdParams(1, EN, EK, TOP_K, E, stride, route=r)

            def run(batch, w=w, params=params):
                enc = dev.command_encoder()
                for _ in range(batch):
                    routemm.dense_matmul_id(enc, reg, w, x1, ids[next(turn) % len(ids)], out, None, params)
                enc.commit_and_wait()

            for batch in (4, 1):
                cases.append((f"experts {name} {r.value} m=1 x{batch}", batch, run))
    for n, k in ((4096, 14336), (2048, 2048)):
        blocks = q4_0.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
        copies = [dev.from_numpy(blocks) for _ in range(4 if n * k > 2**24 else 64)]
        x = dev.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
        q_out = dev.alloc(n * 4, routemm.DType.F32, [1, n])
        params = routemm.GgmlQuantizedMatmulParams(1, n, k)
        policy = routemm.GgmlRoutingPolicy()

        def run_q4(batch, copies=copies, x=x, q_out=q_out, params=params, policy=policy):
            enc = dev.command_encoder()
            for _ in range(batch):
                routemm.quantized_matmul_ggml(enc, reg, x, copies[next(turn) % len(copies)], q_out, params, policy)
            enc.commit_and_wait()

        for batch in (4, 1):
            cases.append((f"Q4_0 {n}x{k} m=1 x{batch}", batch, run_q4))
    return cases


def child() -> None:
    import routemm

    cases = _cases(routemm)
    print("ready", flush=True)
    for _ in sys.stdin:
        times = {}
        for name, batch, run in cases:
            run(batch)  # warm-up
            best = float("inf")
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                run(batch)
                best = min(best, (time.perf_counter() - t0) / batch)
            times[name] = best * 1e6
        print(json.dumps(times), flush=True)


def take_turns(script: str, rounds: int, on_ready, on_round=None) -> dict[str, list[dict]]:
    """Runs `script --child` twice, with the default polling ("polling") and with
    ROUTEMM_CPU_SPIN_US=0 ("sleeping"), and asks each child for a round in turn (`go` on stdin,
    one JSON line back), the first alternating. on_ready(lines) gets the children's first lines
    before the rounds, on_round(results) runs after each; returns each label's rounds. Also used by
    cpu_spin_torch_mix.py."""
    labels = ("polling", "sleeping")
    procs = {}
    for label in labels:
        env = dict(os.environ)
        env.pop("ROUTEMM_CPU_SPIN_US", None)
        if label == "sleeping":
            env["ROUTEMM_CPU_SPIN_US"] = "0"
        procs[label] = subprocess.Popen(
            [sys.executable, script, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
    on_ready([p.stdout.readline().strip() for p in procs.values()])
    results = {label: [] for label in labels}
    for rnd in range(rounds):
        for label in labels if rnd % 2 == 0 else labels[::-1]:
            p = procs[label]
            p.stdin.write("go\n")
            p.stdin.flush()
            results[label].append(json.loads(p.stdout.readline()))
        if on_round:
            on_round(results)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return results


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8

    def check_ready(lines):
        assert lines == ["ready", "ready"], lines

    def report(results):
        row = results["sleeping"][-1]
        print(
            f"round {len(results['sleeping'])}: "
            + "; ".join(f"{name} {row[name]:.0f} -> {results['polling'][-1][name]:.0f}" for name in row),
            flush=True,
        )

    results = take_turns(__file__, rounds, check_ready, report)
    print("\nmedian us per dispatch, sleeping at once (SPIN_US=0) -> polling (default):")
    for name in results["sleeping"][0]:
        a = statistics.median(r[name] for r in results["sleeping"])
        b = statistics.median(r[name] for r in results["polling"])
        wins = sum(p[name] < s[name] for p, s in zip(results["polling"], results["sleeping"], strict=True))
        print(
            f"  {name:<40} {a:8.0f} -> {b:8.0f} us ({(a / b - 1) * 100:+.1f}% speed; polling faster in {wins}/{rounds})"
        )


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else main()
