"""torch.ops.routemm.moe_experts alone (no router): the Qwen3-30B-A3B experts block over bf16 and
GGML Q4_0 / Q8_0 stacks (transformers has no quantised experts, so routemm runs alone here), per m
the automatic route's median time of one eager call (CUDA events around the call, the stream
synchronised after each) and, for --graph-ms, of one replay of the call captured in a CUDA graph.

    python3 bench/tools/moe_op_timing.py [--out DIR] [--ms 1,8,32,512,4096] [--graph-ms 1,8]
        [--formats bf16,q4_0,q8_0] [--exact] [--batch-invariant]

--exact adds, for the bf16 stacks, the same calls with exact=True (the exact direct / grouped
routes) beside the automatic route: the A/B of the fused decode route and the tensor-core route
against the exact ones, per m, on one card. --batch-invariant adds batch_invariant=True for every
format (its cost against the default, per m).

Router-like ids (top-8 of random logits). Writes DIR/moe_op-<card>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import routemm  # noqa: E402
import routemm.torch  # noqa: E402,F401
import torch  # noqa: E402
from transformers_block import time_eager, time_graph  # noqa: E402

E, TOP_K, H, I = 128, 8, 2048, 768  # noqa: E741


def block_stack(gen, n, k, fmt):
    """Random GGML blocks of [E, n, k] with small scales (codes uniform, one f16 scale per block)."""
    values, block_bytes = routemm.GgmlType(fmt).block_layout
    raw = torch.randint(0, 256, (E, n, k // values, block_bytes), generator=gen, dtype=torch.uint8, device="cuda")
    scale = torch.full((E, n, k // values), 2.0**-10, dtype=torch.float16, device="cuda")
    raw[..., :2] = scale.view(torch.uint8).reshape(E, n, k // values, 2)
    return raw.reshape(E, n, k // values * block_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/routemm-out"))
    ap.add_argument("--ms", default="1,8,32,512,4096")
    ap.add_argument("--graph-ms", default="1,8")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--formats", default="bf16,q4_0,q8_0")
    ap.add_argument("--exact", action="store_true", help="also exact=True for the bf16 stacks")
    ap.add_argument("--batch-invariant", action="store_true", help="also batch_invariant=True")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    gen = torch.Generator(device="cuda").manual_seed(5)
    stacks = {
        "bf16": (
            dict(gate_up=(torch.randn((E, 2 * I, H), generator=gen, device="cuda") / H**0.5).bfloat16()),
            (torch.randn((E, H, I), generator=gen, device="cuda") / I**0.5).bfloat16(),
            None,
        ),
    }
    for fmt in ("q4_0", "q8_0"):
        stacks[fmt] = (
            dict(gate_up=block_stack(gen, I, H, fmt), up=block_stack(gen, I, H, fmt)),
            block_stack(gen, H, I, fmt),
            fmt,
        )
    graph_ms = {int(v) for v in args.graph_ms.split(",")}
    records = []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn((m, H), generator=gen, device="cuda").bfloat16()
        logits = torch.randn((m, E), generator=gen, device="cuda")
        weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
        for name, (gu, down, fmt) in stacks.items():
            if name not in formats:
                continue
            routes = ["auto"]
            routes += ["exact"] if args.exact and fmt is None else []
            routes += ["batch_invariant"] if args.batch_invariant else []
            for route in routes:

                def call(gu=gu, down=down, fmt=fmt, route=route):
                    return torch.ops.routemm.moe_experts(
                        x, ids, weights, gu["gate_up"], down, gu.get("up"), fmt, route == "exact",
                        batch_invariant=route == "batch_invariant",
                    )  # fmt: skip

                call()
                base = dict(op="moe_experts_op", shape="qwen3-30b-a3b", m=m, weight_dtype=name, impl="routemm")
                seconds = time_eager(torch, call, True, args.calls)
                records.append({**base, "route": route, "time_us": seconds * 1e6, "note": "eager, CUDA events"})
                print(f"{name} {route} m={m} eager {seconds * 1e6:.1f} us", flush=True)
                if m in graph_ms:
                    g = time_graph(torch, call, args.calls)
                    records.append({**base, "route": route, "time_us": g * 1e6, "note": "CUDA graph replay"})
                    print(f"{name} {route} m={m} graph {g * 1e6:.1f} us", flush=True)
    from conftest import write_results

    path = os.path.join(args.out, f"moe_op-{os.environ.get('CARD', 'gpu')}.json")
    write_results(
        path, device=torch.cuda.get_device_name(0), tool="bench/tools/moe_op_timing.py", records=records,
        torch=torch.__version__,
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
