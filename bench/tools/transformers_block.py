"""The MoE block where a user meets it: transformers' sparse MoE block with its experts
implementation "routemm" beside transformers' own "grouped_mm" and "batched_mm" (and "eager" on the
CPU), one run, same weights, bf16.

    python3 bench/tools/transformers_block.py [--out DIR] [--models qwen3-30b-a3b,mixtral-8x7b]
        [--ms 1,8,32,512,4096] [--graph-ms 1,8] [--smoke]

Per model and m: the median wall time of one block forward (router, top-k, experts; on CUDA from
a CUDA event before the call to one after it, the stream synchronised after each call, so host
launch time counts where it delays the GPU), and for --graph-ms the median replay time of the block
captured in a CUDA graph (an implementation that cannot be captured is recorded with its error).
Each routemm output is checked against grouped_mm's (relative max error in the note), and every
implementation's experts forward against float64 on the same bf16 inputs and weights (a few rows). --smoke runs
reduced shapes on the CPU (what CI's bench smoke test calls). Writes DIR/transformers_block-<card>.json
and .md in the results format of DESIGN.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODELS = {
    "qwen3-30b-a3b": dict(kind="qwen3_moe", hidden=2048, inter=768, experts=128, top_k=8),
    "mixtral-8x7b": dict(kind="mixtral", hidden=4096, inter=14336, experts=8, top_k=2),
}
SMOKE_MODELS = {
    "qwen3-smoke": dict(kind="qwen3_moe", hidden=256, inter=96, experts=16, top_k=4),
    "mixtral-smoke": dict(kind="mixtral", hidden=256, inter=384, experts=4, top_k=2),
}
IMPLS_CUDA = ("routemm", "grouped_mm", "batched_mm")
IMPLS_CPU = ("routemm", "grouped_mm", "batched_mm", "eager")
BATCHED_MM_MAX_M = 512  # batched_mm materialises [m * top_k, 2I, H] weights: 32 GB at m = 4096


def log(*parts) -> None:
    print(*parts, flush=True)


def make_block(torch, cfg: dict, impl: str, device, weights):
    import transformers

    if cfg["kind"] == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = transformers.Qwen3MoeConfig(
            hidden_size=cfg["hidden"], moe_intermediate_size=cfg["inter"], num_experts=cfg["experts"],
            num_experts_per_tok=cfg["top_k"], norm_topk_prob=True,
        )  # fmt: skip
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = transformers.MixtralConfig(
            hidden_size=cfg["hidden"], intermediate_size=cfg["inter"], num_local_experts=cfg["experts"],
            num_experts_per_tok=cfg["top_k"],
        )  # fmt: skip
    config._experts_implementation = impl
    block = Block(config).to(device=device, dtype=torch.bfloat16).eval()
    router, gate_up, down = weights
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block


def output_of(out):
    return out[0] if isinstance(out, tuple) else out


def time_eager(torch, fn, cuda: bool, calls: int) -> float:
    """Median seconds of one call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(calls):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_graph(torch, fn, calls: int) -> float:
    """Median seconds of one replay of fn captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def experts_errors(torch, blocks: dict, cfg: dict, m: int, gen, device) -> dict:
    """{implementation: max relative error of its experts forward against float64} on the same bf16
    hidden states, router-like ids and weights and the same bf16 weights, over a few sampled rows
    (the error relative to the largest reference magnitude of those rows)."""
    h, e, top_k = cfg["hidden"], cfg["experts"], cfg["top_k"]
    x = torch.randn((m, h), generator=gen, device=device).bfloat16()
    probs = torch.softmax(torch.randn((m, e), generator=gen, device=device), -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    any_block = next(iter(blocks.values()))
    gate_up, down = any_block.experts.gate_up_proj.double(), any_block.experts.down_proj.double()
    inter = down.shape[-1]
    rows = sorted({0, m // 2, m - 1})
    want = torch.zeros((len(rows), h), dtype=torch.float64, device=device)
    for i, t in enumerate(rows):
        xt = x[t].double()
        for s in range(top_k):
            ex = int(ids[t, s])
            gu = gate_up[ex] @ xt
            want[i] += float(weights[t, s]) * (down[ex] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    scale = float(want.detach().abs().max())
    errors = {}
    for impl, block in blocks.items():
        if impl == "batched_mm" and m >= BATCHED_MM_MAX_M:
            continue
        try:
            with torch.no_grad():
                got = block.experts(x, ids, weights)[rows].double()
        except Exception as exc:  # noqa: BLE001  (a peer that cannot run this shape, e.g. out of memory)
            log(f"experts error of {impl} at m={m} not measured: {type(exc).__name__}")
            continue
        errors[impl] = float((got - want).abs().max()) / scale
    return errors


def run(args) -> tuple[list, str]:
    import routemm.integrations.transformers as rt
    import torch

    rt.register()
    cuda = not args.smoke and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    models = SMOKE_MODELS if args.smoke else {m: MODELS[m] for m in args.models.split(",")}
    ms = [int(v) for v in args.ms.split(",")]
    graph_ms = {int(v) for v in args.graph_ms.split(",")} if cuda else set()
    impls = IMPLS_CUDA if cuda else IMPLS_CPU
    records = []
    for name, cfg in models.items():
        gen = torch.Generator(device=device).manual_seed(7)
        h, i, e = cfg["hidden"], cfg["inter"], cfg["experts"]
        weights = (
            (torch.randn((e, h), generator=gen, device=device) / h**0.5).bfloat16(),
            (torch.randn((e, 2 * i, h), generator=gen, device=device) / h**0.5).bfloat16(),
            (torch.randn((e, h, i), generator=gen, device=device) / i**0.5).bfloat16(),
        )
        blocks = {impl: make_block(torch, cfg, impl, device, weights) for impl in impls}
        for m in ms:
            x = torch.randn((1, m, h), generator=gen, device=device).bfloat16()
            reference = None
            for impl, block in blocks.items():
                if impl == "batched_mm" and m > BATCHED_MM_MAX_M:
                    continue
                if impl == "eager" and m > 128 and cuda:  # its per-expert loop; on the CPU it is the peer
                    continue
                base = dict(
                    op="moe_block", shape=name, m=m, weight_dtype="bf16", route=impl, impl=f"transformers_{impl}"
                )

                def fwd(block=block):
                    with torch.no_grad():
                        return output_of(block(x))

                try:
                    out = fwd()
                except Exception as exc:  # noqa: BLE001  (a peer that cannot run this shape)
                    log(f"{name} m={m} {impl}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    continue
                if impl == "grouped_mm":
                    reference = out.float()
                calls = args.calls if m <= 512 else max(5, args.calls // 4)
                seconds = time_eager(torch, fwd, cuda, calls)
                note = f"eager, {'CUDA events' if cuda else 'wall'}; torch {torch.__version__}"
                records.append({**base, "time_us": seconds * 1e6, "note": note, "mode": "eager"})
                log(f"{name} m={m} {impl} eager {seconds * 1e6:.1f} us")
                if m in graph_ms:
                    try:
                        g = time_graph(torch, fwd, calls)
                        records.append({**base, "time_us": g * 1e6, "note": "CUDA graph replay", "mode": "graph"})
                        log(f"{name} m={m} {impl} graph {g * 1e6:.1f} us")
                    except Exception as exc:  # noqa: BLE001
                        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                        records.append(
                            {**base, "time_us": float("nan"), "note": f"capture failed: {why}", "mode": "graph"}
                        )
                        log(f"{name} m={m} {impl} graph FAILED {why}")
                        torch.cuda.synchronize()
            with torch.no_grad():
                routemm_out = output_of(blocks["routemm"](x)) if "routemm" in blocks else None
            if reference is not None and routemm_out is not None:
                err = float((routemm_out.float() - reference).abs().max() / reference.abs().max())
                for r in records:
                    if r["shape"] == name and r["m"] == m and r["impl"] == "transformers_routemm":
                        r["note"] += f"; rel err vs grouped_mm {err:.1e}"
            if not args.no_errors:
                errors = experts_errors(torch, blocks, cfg, m, gen, device)
                for r in records:
                    impl = r["route"]
                    if r["shape"] == name and r["m"] == m and r["mode"] == "eager" and impl in errors:
                        r["note"] += f"; experts vs float64: {errors[impl]:.1e}"
                log(f"{name} m={m} experts error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU (smoke run)" if args.smoke else "CPU"
    return records, device_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/routemm-out"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ms", default="1,8,32,512,4096")
    ap.add_argument("--graph-ms", default="1,8")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="reduced shapes on the CPU")
    ap.add_argument("--no-errors", action="store_true", help="skip the experts' float64 comparison")
    args = ap.parse_args(argv)
    if args.smoke and args.ms == "1,8,32,512,4096":
        args.ms = "1,8,64"
    os.makedirs(args.out, exist_ok=True)
    records, device_name = run(args)
    import torch
    from conftest import write_results

    tag = "cpu-smoke" if args.smoke else os.environ.get("CARD", "gpu")
    path = os.path.join(args.out, f"transformers_block-{tag}.json")
    write_results(
        path, device=device_name, tool="bench/tools/transformers_block.py", records=records, torch=torch.__version__
    )
    log(f"wrote {path} and its .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
