"""Expert-parallel MoE experts block: routemm.integrations.distributed.ep_moe_experts beside a plain
torch.distributed + torch._grouped_mm EP layer and beside the same layer on one GPU.

    torchrun --nproc_per_node=W bench/tools/ep_timing.py [--out DIR] [--ms 1,8,128,4096]
        [--shapes deepseek_v3,qwen3_235b] [--dtypes bf16,q4_0,q4_k] [--reps 10]
    torchrun --nproc_per_node=2 bench/tools/ep_timing.py --device cpu --shapes tiny --ms 1,8   # smoke

Per shape (DeepSeek-V3: 256 experts, top-8, H 7168, I 2048; Qwen3-235B-A22B: 128 experts, top-8,
H 4096, I 1536), stack dtype (bf16; block stacks of any GGML type routemm runs, q4_0 or q4_k
for instance, routemm only: torch has no grouped matmul over them) and m tokens per rank, every rank starting each timed call
together (a barrier, then the device synchronised), medians of:
- routemm: the layer and its three steps on the exact routes (dispatch: counts and rows
  all-to-all; experts: the local experts; combine: rows back, slots, ordered combine), and the
  layer with exact=False (the local experts on the op's automatic route: tensor cores on CUDA);
- torch: the same dispatch, torch._grouped_mm over the rows sorted by expert, SiLU * up, the rows
  back and the weighted sum in torch (bf16 only);
- one device: rank 0 alone, the layer on every rank's W * m tokens with the whole stacks (exact
  and automatic routes), where the stacks fit in its memory.
Experts contiguous over the ranks, router-like ids (top-k of random logits). NCCL on CUDA, gloo on
the CPU. Rank 0 writes DIR/ep_timing-<card>-w<W>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import routemm.torch  # noqa: F401  (torch.ops.routemm.*)
import torch
import torch.distributed as dist
from routemm.integrations import distributed as ep

SHAPES = {  # experts, top_k, hidden, intermediate
    "deepseek_v3": (256, 8, 7168, 2048),
    "qwen3_235b": (128, 8, 4096, 1536),
    "tiny": (16, 4, 64, 32),
    "tiny_k": (16, 4, 256, 256),  # K-quant super-blocks: K a multiple of 256
}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> float:
    """Median milliseconds of fn() over reps runs (one warm-up), every rank starting together."""
    times = []
    for i in range(reps + 1):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def block_stack(gen, e, n, k, device, ggml_type: str):
    """GGML blocks of `ggml_type` for [e, n, k]: one expert's random weights quantised (routemm.quantize)
    and repeated for every expert, so that a large stack costs one quantisation; the kernels read
    every expert's bytes all the same."""
    one = torch.randn((n, k), generator=gen).numpy() / k**0.5
    blocks = torch.from_numpy(routemm.quantize(one, ggml_type))
    return blocks.unsqueeze(0).expand(e, *blocks.shape).contiguous().to(device)


def stacks(n_experts, hidden, inter, dtype: str, device, seed: int):
    """bf16 stacks, or block stacks of a GGML type (dtype one of routemm's SUPPORTED_TYPES values)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype != "bf16":
        return block_stack(gen, n_experts, 2 * inter, hidden, device, dtype), block_stack(
            gen, n_experts, hidden, inter, device, dtype
        )
    gate_up = (torch.randn((n_experts, 2 * inter, hidden), generator=gen) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn((n_experts, hidden, inter), generator=gen) / inter**0.5).to(torch.bfloat16)
    return gate_up.to(device), down.to(device)


def baseline_experts(d, gate_up, down) -> torch.Tensor:
    """The received rows through torch._grouped_mm: sorted by local expert, gate/up, SiLU * up, down,
    back in arrival order (float32 rows, bf16 matmuls)."""
    if not d.rows.shape[0]:
        return d.rows
    order = torch.sort(d.local_ids, stable=True).indices
    offs = torch.cumsum(torch.bincount(d.local_ids, minlength=gate_up.shape[0]), 0).to(torch.int32)
    x = d.rows[order].to(torch.bfloat16)
    gu = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
    inter = gate_up.shape[1] // 2
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(h, down.transpose(-2, -1), offs=offs).to(torch.float32)
    out = torch.empty_like(y)
    out[order] = y
    return out


def baseline_combine(d, done, weights) -> torch.Tensor:
    back = d.rows.new_empty((int(d.sent.shape[0]), d.rows.shape[1]))
    dist.all_to_all_single(back, done, d.send_split, d.recv_split)
    slot_rows = d.rows.new_zeros((d.m * d.top_k, d.rows.shape[1]))
    slot_rows[d.sent] = back
    return (slot_rows.view(d.m, d.top_k, -1) * weights[..., None]).sum(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/routemm-out"))
    ap.add_argument("--ms", default="1,8,128,4096")
    ap.add_argument("--shapes", default="deepseek_v3,qwen3_235b")
    ap.add_argument("--dtypes", default="bf16,q4_0,q4_k")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    card = torch.cuda.get_device_name(device).replace(" ", "_") if cuda else "cpu"
    rows = []
    for shape in args.shapes.split(","):
        n_experts, top_k, hidden, inter = SHAPES[shape]
        placement = ep.ExpertPlacement.contiguous(n_experts, world)
        mine = list(placement.local_experts(rank))
        for dtype in args.dtypes.split(","):
            full_gu, full_down = stacks(n_experts, hidden, inter, dtype, "cpu", seed=0)
            gate_up, down = full_gu[mine].to(device), full_down[mine].to(device)
            ggml_type = None if dtype == "bf16" else dtype
            for m in (int(v) for v in args.ms.split(",")):
                gen = torch.Generator().manual_seed(1 + rank)
                logits = torch.randn((m, n_experts), generator=gen)
                weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
                x = torch.randn((m, hidden), generator=gen).to(device)
                ids, weights = ids.to(device), weights.to(device)
                row = {"shape": shape, "dtype": dtype, "m_per_rank": m, "world": world, "card": card}

                def layer():
                    ep.ep_moe_experts(x, ids, weights, gate_up, down, placement=placement, ggml_type=ggml_type)

                def dispatch():
                    return ep._dispatch(x, ids, placement, world, None)

                d = dispatch()
                done = ep._local_experts(d, gate_up, down, None, ggml_type)
                row["routemm_ms"] = timed(layer, device, args.reps)
                row["routemm_auto_ms"] = timed(
                    lambda: ep.ep_moe_experts(
                        x, ids, weights, gate_up, down, placement=placement, ggml_type=ggml_type, exact=False
                    ),
                    device,
                    args.reps,
                )
                row["routemm_dispatch_ms"] = timed(dispatch, device, args.reps)
                row["routemm_experts_ms"] = timed(
                    lambda: ep._local_experts(d, gate_up, down, None, ggml_type), device, args.reps
                )
                row["routemm_combine_ms"] = timed(
                    lambda: ep._combine(d, done, weights, ids, n_experts, None), device, args.reps
                )
                if dtype == "bf16":
                    base_done = baseline_experts(d, gate_up, down)

                    def base_layer():
                        dd = dispatch()
                        baseline_combine(dd, baseline_experts(dd, gate_up, down), weights)

                    row["torch_ms"] = timed(base_layer, device, args.reps)
                    row["torch_experts_ms"] = timed(lambda: baseline_experts(d, gate_up, down), device, args.reps)
                    row["torch_combine_ms"] = timed(lambda: baseline_combine(d, base_done, weights), device, args.reps)
                    row["routemm_over_torch"] = row["routemm_ms"] / row["torch_ms"]
                    row["routemm_auto_over_torch"] = row["routemm_auto_ms"] / row["torch_ms"]
                rows.append(row)
            gate_up = down = None  # free the local stacks before rank 0 loads the whole ones
            # The same layer on one device: rank 0 alone, every rank's tokens, the whole stacks.
            if rank == 0:
                need = (full_gu.numel() + full_down.numel()) * full_gu.element_size()
                free = torch.cuda.mem_get_info(device)[0] if cuda else need * 2
                for row in rows:
                    if row["shape"] != shape or row["dtype"] != dtype:
                        continue
                    if need > 0.8 * free:
                        row["one_device_ms"] = row["one_device_auto_ms"] = None  # does not fit
                        continue
                    gu1, dn1 = full_gu.to(device), full_down.to(device)
                    mm = row["m_per_rank"] * world
                    gen = torch.Generator().manual_seed(99)
                    weights, ids = torch.topk(torch.softmax(torch.randn((mm, n_experts), generator=gen), -1), top_k)
                    x = torch.randn((mm, hidden), generator=gen).to(device)
                    ids, weights = ids.to(device), weights.to(device)

                    for key, exact in (("one_device_ms", True), ("one_device_auto_ms", False)):
                        times = []
                        for i in range(args.reps + 1):
                            _sync(device)
                            start = time.perf_counter()
                            torch.ops.routemm.moe_experts(x, ids, weights, gu1, dn1, None, ggml_type, exact)
                            _sync(device)
                            if i:
                                times.append((time.perf_counter() - start) * 1e3)
                        row[key] = statistics.median(times)
                    del gu1, dn1
            dist.barrier()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"ep_timing-{card}-w{world}")
        with open(stem + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        cols = ["shape", "dtype", "m_per_rank", "routemm_ms", "routemm_dispatch_ms", "routemm_experts_ms",
                "routemm_combine_ms", "routemm_auto_ms", "torch_ms", "torch_experts_ms", "torch_combine_ms",
                "routemm_over_torch", "routemm_auto_over_torch", "one_device_ms", "one_device_auto_ms"]  # fmt: skip
        lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        for row in rows:
            cells = [row.get(c) for c in cols]
            lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in cells) + " |")
        with open(stem + ".md", "w") as f:
            f.write(f"{card}, world {world}\n\n" + "\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
