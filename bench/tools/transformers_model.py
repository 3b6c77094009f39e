"""A whole model where a user meets routemm: a Qwen3-30B-A3B-architecture model (48 layers, 128
experts, top-8, random weights, bf16) through transformers, experts implementation "routemm" beside
"grouped_mm", one run, the same weights (the implementation is switched in place).

    python3 bench/tools/transformers_model.py [--out DIR] [--layers 48] [--prefill 4096]
        [--decode 64] [--impls routemm,grouped_mm] [--smoke]

Per implementation:
- prefill: tokens/s of one forward over --prefill tokens (no cache), median of 3 after a warm-up;
- decode, eager: tokens/s of model.generate() with a static cache and compilation disabled
  (transformers itself switches grouped_mm to batched_mm while decoding on a GPU, its fastest);
- one-token step, CUDA graph: the model's forward over one token with no KV cache, captured with
  torch.cuda.graph and replayed: 1 / replay time. That is a decode step's work but for attending
  over the cached context (32 tokens in generate() above), the same for every implementation. A
  step over transformers' StaticCache is not used: its capture ended in a device-side assert for
  every implementation (routemm, grouped_mm and eager alike; transformers 5.17, torch 2.11, H100).
  An implementation that cannot be captured is recorded with the error.
Writes DIR/transformers_model-<card>.json and .md (results format of DESIGN.md). --smoke: 2 tiny
layers on the CPU (prefill and eager decode only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def log(*parts) -> None:
    print(*parts, flush=True)


def config(transformers, layers: int, smoke: bool):
    if smoke:
        return transformers.Qwen3MoeConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=512,
        )  # fmt: skip
    return transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=8192,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


def seconds(torch, fn, cuda: bool, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def graph_step_seconds(torch, model, prompt, reps: int) -> float:
    """Replay time of the one-token forward (no KV cache) captured in a CUDA graph."""
    with torch.no_grad():
        token = prompt[:, -1:].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(input_ids=token, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(input_ids=token, use_cache=False)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/routemm-out"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--impls", default="routemm,grouped_mm")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-graph", action="store_true", help="skip the captured decode step")
    args = ap.parse_args(argv)
    import routemm.integrations.transformers as rt
    import torch
    import transformers

    rt.register()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    layers = 2 if args.smoke else args.layers
    prefill = 64 if args.smoke else args.prefill
    decode = 8 if args.smoke else args.decode
    cfg = config(transformers, layers, args.smoke)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with device:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # every weight drawn here (N(0, 0.02), norms at 1), whatever from_config left
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    log(
        f"model built in {time.perf_counter() - t0:.0f} s, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params"
    )
    shape = f"qwen3-30b-a3b-{layers}l" if not args.smoke else "qwen3-smoke-2l"
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, prefill), generator=gen, device=device)
    records, logits = [], {}
    for impl in args.impls.split(","):
        model.set_experts_implementation(impl)
        base = dict(op="model", shape=shape, weight_dtype="bf16", route=impl, impl=f"transformers_{impl}")

        def forward():
            with torch.no_grad():
                return model(input_ids=tokens, use_cache=False).logits

        logits[impl] = forward()[0, -1].float()
        s = seconds(torch, forward, cuda, 3)
        records.append({**base, "m": prefill, "time_us": s * 1e6, "note": f"prefill: {prefill / s:.0f} tokens/s"})
        log(f"{impl} prefill {prefill} tokens: {s * 1e3:.1f} ms, {prefill / s:.0f} tokens/s")
        prompt = tokens[:, :32]

        def generate():
            with torch.no_grad():
                model.generate(
                    prompt, max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                    cache_implementation="static", disable_compile=True, pad_token_id=0,
                )  # fmt: skip

        s = seconds(torch, generate, cuda, 2)
        records.append(
            {
                **base,
                "m": 1,
                "time_us": s / decode * 1e6,
                "note": f"decode, eager generate(): {decode / s:.1f} tokens/s",
            }
        )
        log(f"{impl} decode eager: {decode / s:.1f} tokens/s")
        if cuda and not args.no_graph:
            try:
                g = graph_step_seconds(torch, model, prompt, 20)
                note = f"one-token step (no KV cache), CUDA graph: {1 / g:.1f} tokens/s"
                records.append({**base, "m": 1, "time_us": g * 1e6, "note": note})
                log(f"{impl} one-token step in a CUDA graph: {1 / g:.1f} tokens/s")
            except Exception as exc:  # noqa: BLE001  (an implementation that cannot be captured)
                traceback.print_exc()
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                records.append({**base, "m": 1, "time_us": float("nan"), "note": f"CUDA graph capture failed: {why}"})
                log(f"{impl} decode graph FAILED: {why}")
                torch.cuda.synchronize()
    if "routemm" in logits and len(logits) > 1:
        other = next(k for k in logits if k != "routemm")
        err = float((logits["routemm"] - logits[other]).abs().max() / logits[other].abs().max())
        for r in records:
            if r["impl"] == "transformers_routemm":
                r["note"] += f"; last-token logits vs {other}: rel err {err:.1e}"
    from conftest import write_results

    tag = "cpu-smoke" if args.smoke else os.environ.get("CARD", "gpu")
    path = os.path.join(args.out, f"transformers_model-{tag}.json")
    write_results(
        path, device=torch.cuda.get_device_name(0) if cuda else "CPU (smoke run)",
        tool="bench/tools/transformers_model.py", records=records, torch=torch.__version__,
        transformers=transformers.__version__,
    )  # fmt: skip
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
