"""torch.ops.routemm.moe_experts(..., batch_invariant=True): a token's output bits are the same
whatever else is in the batch and however large it is (m = 1 up to past every route crossover:
the fused decode route, grouped, and on CUDA the tensor-core route from m * top_k >= 2E), on
float stacks in the model's dtypes and on block stacks, with both kernel sets. The mode keeps one
per-row order at every m: on CUDA the tensor-core route for the stacks that have it (f16/bf16,
Q4_0/Q8_0), elsewhere the default's routes (the exact rule, or the CPU's bf16-dot family)."""

from __future__ import annotations

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch as rt  # noqa: E402,F401  (registers the ops)

E, H, I, TOP_K = 8, 64, 32, 2  # noqa: E741
PROBE = 17  # the token followed through the batches (its row: PROBE, or the last of a smaller batch)


def _stacks(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind in ("f32", "f16", "bf16"):
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind]
        gate_up = (torch.randn((E, 2 * I, H), generator=g) / H**0.5).to(dtype)
        down = (torch.randn((E, H, I), generator=g) / I**0.5).to(dtype)
        return dict(gate_up=gate_up, down=down), dtype
    rng = np.random.default_rng(seed)
    gate_up = routemm.quantize(rng.standard_normal((E, 2 * I, H)).astype(np.float32), kind)
    down = routemm.quantize(rng.standard_normal((E, H, I)).astype(np.float32), kind)
    return dict(gate_up=torch.from_numpy(gate_up), down=torch.from_numpy(down), ggml_type=kind), torch.bfloat16


def _batch(m: int, probe: tuple, dtype, seed: int):
    """m random tokens with the probe token (x, ids, weights) at row PROBE (or alone at m = 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, H), generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).to(torch.int32)
    w = torch.rand((m, TOP_K), generator=g).to(dtype)
    row = min(PROBE, m - 1)
    x[row], ids[row], w[row] = probe
    return x, ids, w, row


def _probe(dtype):
    g = torch.Generator().manual_seed(99)
    return (
        torch.randn(H, generator=g).to(dtype),
        torch.tensor([3, 5], dtype=torch.int32),
        torch.rand(2, generator=g).to(dtype),
    )


def _run(tdev, stacks, x, ids, w, **kw):
    args = {k: (v.to(tdev) if isinstance(v, torch.Tensor) else v) for k, v in stacks.items()}
    gate_up, down = args.pop("gate_up"), args.pop("down")
    return torch.ops.routemm.moe_experts(x.to(tdev), ids.to(tdev), w.to(tdev), gate_up, down, **args, **kw).cpu()


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32", "q4_0", "q8_0"])
def test_a_tokens_bits_do_not_depend_on_the_batch(tdev, kind):
    stacks, dtype = _stacks(kind)
    probe = _probe(dtype)
    outs = []
    for m, seed in ((1, 1), (9, 2), (40, 3), (300, 4), (300, 5)):
        x, ids, w, row = _batch(m, probe, dtype, seed)
        outs.append(_run(tdev, stacks, x, ids, w, batch_invariant=True)[row])
    first = outs[0].view(torch.int16 if dtype != torch.float32 else torch.int32)
    for got in outs[1:]:
        assert torch.equal(got.view(first.dtype), first)
    # The mode's route at every m: on CUDA the tensor-core route's bits where the stacks have it
    # (the default at m = 300), elsewhere the default's (the exact routes, or the CPU's bf16-dot
    # routes for bf16 stacks), which never switch family with m off CUDA.
    x, ids, w, row = _batch(300, probe, dtype, 4)
    want = _run(tdev, stacks, x, ids, w, exact=tdev == "cuda" and kind in ("f32",))
    assert torch.equal(_run(tdev, stacks, x, ids, w, batch_invariant=True), want)
    if tdev != "cuda":
        x, ids, w, row = _batch(1, probe, dtype, 1)
        assert torch.equal(_run(tdev, stacks, x, ids, w, batch_invariant=True), _run(tdev, stacks, x, ids, w))


def test_the_route_rule_of_the_mode():
    """On CUDA the mode takes the tensor-core route from m = 1 where the stacks have it (the
    default takes it from 2 rows per expert); off CUDA, or under force_simd, it is the default's."""
    rule = routemm._core._moe_experts_auto_route
    bf16, f32 = routemm.DType.BF16, routemm.DType.F32
    for m in (1, 8, 4096):
        assert rule("cuda", m, 8, 128, bf16, False, False, True, batch_invariant=True) == "grouped_tensor_lowp"
        assert (
            rule("cuda", m, 8, 128, routemm.DType.U8, True, False, True, batch_invariant=True) == "grouped_tensor_lowp"
        )
        assert rule("cuda", m, 8, 128, f32, False, False, True, batch_invariant=True) == rule(
            "cuda", m, 8, 128, f32, False, True, True
        )
        assert rule("cuda", m, 8, 128, bf16, False, False, False, batch_invariant=True) == rule(
            "cuda", m, 8, 128, bf16, False, True, True
        )
        for bf16_dot in (False, True):
            assert rule("cpu", m, 8, 128, bf16, False, False, True, bf16_dot, batch_invariant=True) == rule(
                "cpu", m, 8, 128, bf16, False, False, True, bf16_dot
            )
    assert rule("cuda", 1, 8, 128, bf16, False, False, True) == "direct"  # the default's crossover
    assert rule("cuda", 1, 8, 128, bf16, False, True, True, batch_invariant=True) == "direct"  # exact wins


def test_both_kernel_sets_take_batch_invariant():
    stacks, dtype = _stacks("bf16")
    x, ids, w, _ = _batch(40, _probe(dtype), dtype, 3)
    op = torch.ops.routemm.moe_experts(x, ids, w, stacks["gate_up"], stacks["down"], batch_invariant=True)
    python = rt._moe_experts(x, ids, w, stacks["gate_up"], stacks["down"], batch_invariant=True)
    assert torch.equal(op, python)


def test_batch_invariant_traces_and_keeps_its_gradients():
    stacks, dtype = _stacks("f32")
    x, ids, w, _ = _batch(9, _probe(dtype), dtype, 2)
    x.requires_grad_(True)

    def block(x):
        return torch.ops.routemm.moe_experts(x, ids, w, stacks["gate_up"], stacks["down"], batch_invariant=True)

    compiled = torch.compile(block, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), block(x))
    block(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
