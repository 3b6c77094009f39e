"""torch.ops.routemm.moe_gate: the router gate as a torch op (one crossing into the core, the
current stream, no host wait). The bits of routemm.moe_gate's NumPy front door on the same backend,
the same checks and messages from both kernel sets, fake tensors and torch.compile(fullgraph=True),
a refusal at backward (the gate has no gradient), and on CUDA no host sync and capture in a CUDA
graph."""

from __future__ import annotations

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
import routemm.torch as rt  # noqa: E402
from torch_devices import have_torch_cuda  # noqa: E402


def _logits(m: int, n_experts: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn((m, n_experts), generator=torch.Generator().manual_seed(seed))
    if m > 2:
        logits[1, 3] = float("nan")  # ranks as -inf
        logits[2, :] = float("-inf")  # no logit above -inf: weights 0, ids 0..top_k-1
    return logits


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("m, n_experts, top_k", [(1, 8, 2), (5, 16, 4), (40, 128, 8)])
def test_the_numpy_front_doors_bits(m, n_experts, top_k, renormalize):
    logits = _logits(m, n_experts)
    weights, ids = torch.ops.routemm.moe_gate(logits, top_k, renormalize)
    want_w, want_ids = routemm.moe_gate(logits.numpy(), top_k, renormalize=renormalize, device="cpu")
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert np.array_equal(weights.numpy(), want_w) and np.array_equal(ids.numpy(), want_ids)
    tensor_w, tensor_ids = routemm.moe_gate(logits, top_k, renormalize=renormalize)
    assert torch.equal(tensor_w, weights) and torch.equal(tensor_ids, ids)


def test_non_contiguous_logits_are_read_as_their_values():
    logits = _logits(6, 32).T.contiguous().T  # a transposed view of a contiguous copy
    assert not logits.is_contiguous()
    got = torch.ops.routemm.moe_gate(logits, 4, True)
    want = torch.ops.routemm.moe_gate(logits.contiguous(), 4, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "logits, top_k, message",
    [
        (torch.zeros(8), 2, r"router_logits must be 2-D, got shape \(8,\)"),
        (torch.zeros(3, 8, dtype=torch.float16), 2, "router_logits must be float32, got torch.float16"),
        (torch.zeros(3, 8), 0, r"top_k 0 must be in \[1, n_experts = 8\]"),
        (torch.zeros(3, 8), 9, r"top_k 9 must be in \[1, n_experts = 8\]"),
    ],
)
def test_both_kernel_sets_refuse_with_the_same_message(logits, top_k, message):
    with pytest.raises(ValueError, match=message) as from_op:
        torch.ops.routemm.moe_gate(logits, top_k, True)
    with pytest.raises(routemm.InvalidArgumentError) as from_python:
        rt._moe_gate(logits, top_k, True)
    assert str(from_op.value) == str(from_python.value)


def test_fake_and_torch_compile_fullgraph():
    logits = _logits(4, 16)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        w, ids = torch.ops.routemm.moe_gate(mode.from_tensor(logits), 4, True)
    assert (w.shape, w.dtype, ids.shape, ids.dtype) == ((4, 4), torch.float32, (4, 4), torch.int32)
    compiled = torch.compile(lambda x: torch.ops.routemm.moe_gate(x, 4, True), fullgraph=True)
    eager = torch.ops.routemm.moe_gate(logits, 4, True)
    assert all(torch.equal(a, b) for a, b in zip(compiled(logits), eager, strict=True))


def test_the_gate_refuses_a_gradient_at_backward():
    logits = _logits(3, 8).nan_to_num(0.0).requires_grad_()
    weights, ids = torch.ops.routemm.moe_gate(logits, 2, True)
    assert weights.requires_grad and not ids.requires_grad
    with pytest.raises(routemm.UnsupportedError, match="routemm::moe_gate has no gradient.*router_logits"):
        weights.sum().backward()
    with torch.no_grad():
        assert not torch.ops.routemm.moe_gate(logits, 2, True)[0].requires_grad


@pytest.mark.skipif(not have_torch_cuda(), reason="needs a CUDA device and routemm's CUDA backend")
def test_cuda_no_sync_and_graph_capture():
    logits = _logits(16, 128).cuda()
    first = torch.ops.routemm.moe_gate(logits, 8, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.routemm.moe_gate(logits, 8, True)
    torch.cuda.synchronize()
    routemm.reset_encoder_counters()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            got = torch.ops.routemm.moe_gate(logits, 8, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    c = routemm.encoder_counters()
    assert (c["host_waits"], c["streams_created"], c["device_allocations"]) == (0, 0, 0)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True))
    graph = torch.cuda.CUDAGraph()
    static = logits.clone()
    with torch.cuda.graph(graph):
        captured = torch.ops.routemm.moe_gate(static, 8, True)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, first, strict=True))
