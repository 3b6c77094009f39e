"""CPU benchmark of a whole Qwen3-30B-A3B-shaped MoE block: router, top-k gate and the SiLU experts.

routemm (routemm.MoeLayer: router + moe_gate + moe_experts in one submission, bf16 or Q4_0 experts,
F32 activations) beside transformers' own Qwen3MoeSparseMoeBlock with its "eager", "batched_mm" and
"grouped_mm" experts implementations on the same bf16 weights (torch CPU), all in one run, with a
float64 check of routemm's output. The Qwen3-30B-A3B block (E 128, top-8, hidden 2048, expert
intermediate 768) is reduced to hidden 1024 / intermediate 384 by default so that two CPU cores run
it in minutes; ROUTEMM_BENCH_MOE_FULL=1 uses the full sizes.

    python -m pytest bench/bench_moe_block.py -p no:cacheprovider --results bench/results/moe_block-cpu.json
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pytest
import routemm
from routemm import DType

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

E, TOP_K = 128, 8
H, INTER = (2048, 768) if os.environ.get("ROUTEMM_BENCH_MOE_FULL") == "1" else (1024, 384)
SHAPE = "qwen3-30b-a3b" if H == 2048 else f"qwen3-30b-a3b-reduced(H{H},I{INTER})"
ROUNDS = {1: 20, 128: 3}
PEERS = ("eager", "batched_mm", "grouped_mm")


def _median_us(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    router = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
    gate_up = (rng.standard_normal((E, 2 * INTER, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, H, INTER)) / np.sqrt(INTER)).astype(np.float32)
    return router, gate_up, down


def _routemm_layer(device, weights, expert_type: str) -> routemm.MoeLayer:
    router, gate_up, down = weights
    stacks = (gate_up[:, :INTER], gate_up[:, INTER:], down)
    if expert_type == "q4_0":
        bufs = [device.from_numpy(routemm.q4_0.quantize(w)) for w in stacks]
        ggml_type = routemm.GgmlType.Q4_0
    else:
        bufs = [device.from_numpy(np.ascontiguousarray(torch.from_numpy(w).bfloat16().view(torch.uint16).numpy()))
                .view(0, w.size * 2, DType.BF16, list(w.shape)) for w in stacks]  # fmt: skip
        ggml_type = None
    return routemm.MoeLayer(
        device.from_numpy(router), *bufs, top_k=TOP_K, renormalize=True, ggml_type=ggml_type, device=device
    )


def _transformers_block(weights, implementation: str):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    router, gate_up, down = weights
    config = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K, norm_topk_prob=True
    )
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router))
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
        block.experts.down_proj.copy_(torch.from_numpy(down))
    return block


@pytest.mark.parametrize("m", sorted(ROUNDS))
def test_moe_block(weights, results, m):
    device = routemm.Device("cpu")
    rng = np.random.default_rng(m)
    hidden = rng.standard_normal((m, H)).astype(np.float32)
    bytes_bf16 = 3 * E * INTER * H * 2  # every expert's bytes, an upper bound on what a block reads
    for expert_type in ("bf16", "q4_0"):
        layer = _routemm_layer(device, weights, expert_type)
        out = layer(hidden)
        ref, _, _ = layer.reference(hidden)
        rel = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
        assert rel < 1e-4, f"routemm {expert_type} block differs from float64 by {rel:.2e}"
        t = _median_us(lambda layer=layer: layer(hidden), ROUNDS[m])
        touched = len(np.unique(layer.reference(hidden)[1]))
        results.add(
            op="moe_block", shape=SHAPE, m=m, weight_dtype=expert_type, route="grouped" if m >= 9 else "direct",
            impl="routemm", time_us=t, note=f"router+gate+experts, {touched} experts touched, max rel err {rel:.1e}",
        )  # fmt: skip
    x = torch.from_numpy(hidden).bfloat16().reshape(1, m, H)
    for implementation in PEERS:
        block = _transformers_block(weights, implementation)
        with torch.no_grad():
            t = _median_us(lambda block=block: block(x), ROUNDS[m])
        results.add(
            op="moe_block", shape=SHAPE, m=m, weight_dtype="bf16", route=implementation,
            impl=f"transformers_{implementation}", time_us=t,
            note=f"torch {torch.__version__} CPU, bf16 activations; all experts {bytes_bf16 / 1e6:.0f} MB",
        )  # fmt: skip
