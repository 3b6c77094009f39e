"""GgmlRoutingPolicy.expert_q8_0_mv_nr2: Q8_0's direct expert-ID route on the nr2 pipeline
(quantized_matmul_id_direct_q8_0_f32_nr2, CPU and Metal). Each routed row equals the dense
kernel_mul_mv_q8_0_f32_nr2 on its expert's matrix bit for bit and meets the F32 bound of float64;
the policy (explicit, frozen into the registry, or the environment's) picks it for Q8_0 direct
calls only, the receipt names it, and off (the default) keeps the direct pipeline and its bits.

Runs on every backend with the pipeline (ROUTEMM_TEST_BACKENDS selects them); CUDA has none and
keeps its direct pipeline under either setting."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DType, GgmlType, q8_0
from routemm import GgmlQuantizedMatmulIdRoute as Route
from routemm.ops import dense_matmul_id as dmi
from routemm.ops import quantized_matmul_id as qmi
from support import (
    PAD_BYTE,
    guarded,
    guarded_output,
    reference,
    run_ggml_guarded,
    run_python,
    sprinkle_invalid,
    validate,
)

NR2 = routemm.GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE
DIRECT_Q8 = routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES[1]
Policy = routemm.GgmlRoutingPolicy
ON, OFF = Policy(expert_q8_0_mv_nr2=True), Policy()
REL = 2.0**-20  # the F32 accumulation bound against float64 (test_quantized_matmul_id's)


def stack(rng, n_experts, n, k, pad=6):
    """(Q8_0 stack bytes with `pad` bytes between experts, stride, blocks [E, n, k / 32 * 34])."""
    blocks = q8_0.quantize(rng.uniform(-1.0, 1.0, (n_experts, n, k)).astype(np.float32))
    matrix = blocks[0].nbytes
    data = np.full((n_experts - 1) * (matrix + pad) + matrix, PAD_BYTE, np.uint8)
    for e in range(n_experts):
        data[e * (matrix + pad) : e * (matrix + pad) + matrix] = blocks[e].reshape(-1)
    return data, matrix + pad, blocks


def run(device, registry, ggml_type, route, weights, stride, x, ids, n, n_experts, slotted, routing):
    """(output, receipt, encoded dispatches of the product) of one quantized_matmul_id_ggml call."""
    m, top_k = ids.shape
    w = guarded(device, weights, DType.U8, (weights.size,))
    xb = guarded(device, x, DType.F32, x.shape)
    ib = guarded(device, ids, DType.U32, ids.shape)
    out = guarded_output(device, m * top_k, n)
    layout = Layout.SLOTTED if slotted else Layout.SHARED_PER_TOKEN
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, x.shape[-1], top_k, n_experts, ggml_type, stride, layout, route)
    scratch = routemm.DenseMatmulIdScratch(device, n_experts, m) if route.is_grouped else None
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(2)
    receipt = routemm.quantized_matmul_id_ggml(
        encoder, registry, xb.view, w.view, ib.view, out.view, scratch, params, routing=routing
    )
    dispatches = encoder.take_encoded_dispatch_receipt()
    encoder.commit_and_wait()
    for guarded_input, what in ((w, "weights"), (xb, "input"), (ib, "ids")):
        guarded_input.assert_unchanged(what)
    out.assert_guards_intact("output")
    return out.view.numpy().reshape(m * top_k, n).copy(), receipt, dispatches[-1]


def needs_nr2(registry):
    if not registry.has_kernel(NR2):
        pytest.skip(f"{NR2} is not registered on this backend")


@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize("m,top_k,n,k,n_experts", [(1, 4, 7, 96, 6), (3, 2, 33, 2080, 4), (5, 1, 2, 32, 3)])
def test_routed_rows_equal_the_dense_nr2_on_their_expert(device, registry, rng, slotted, m, top_k, n, k, n_experts):
    needs_nr2(registry)
    weights, stride, blocks = stack(rng, n_experts, n, k)
    ids = sprinkle_invalid(rng, rng.integers(0, n_experts, (m, top_k)).astype(np.uint32), n_experts, 0.2)
    ids[0, 0] = ids[-1, -1] = 0  # an id repeated within and across tokens
    x = rng.standard_normal((m * top_k if slotted else m, k)).astype(np.float32)
    got, receipt, dispatch = run(
        device, registry, GgmlType.Q8_0, Route.DIRECT, weights, stride, x, ids, n, n_experts, slotted, ON
    )
    assert receipt == routemm.GgmlQuantizedMatmulIdDispatchReceipt(GgmlType.Q8_0, Route.DIRECT, 1, NR2)
    assert dispatch.pipeline_label == NR2
    assert (dispatch.grid, dispatch.threads_per_threadgroup) == (((n + 1) // 2, m * top_k, 1), (32, 4, 1))
    assert dispatch.threadgroup_memory == ((0, 256),)
    flat_ids = ids.reshape(-1).astype(np.int64)
    rows = x if slotted else np.repeat(x, top_k, axis=0)
    for flat, expert in enumerate(flat_ids):
        if expert >= n_experts:
            assert not np.any(got[flat].view(np.uint32)), flat  # +0.0, no weight read
            continue
        dense, dense_receipt = run_ggml_guarded(
            device, registry, GgmlType.Q8_0, blocks[expert], rows[flat : flat + 1], n, OFF
        )
        assert dense_receipt.dispatch.pipeline_label.split("|")[0] == routemm.Q8_0_MAT_VEC_NR2_PIPELINE
        np.testing.assert_array_equal(got[flat].view(np.uint32), dense[0].view(np.uint32), err_msg=f"row {flat}")
    ref, mag = reference(q8_0.dequantize(blocks), x, ids, slotted)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= REL * mag * k**0.5 + 1e-30)


def test_cpu_nr2_keeps_the_lane_contract_bits(rng):
    """On the CPU both Q8_0 direct pipelines give the lane contract's bits (as the dense pair)."""
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    weights, stride, _ = stack(rng, 4, 19, 256)
    ids = rng.integers(0, 4, (3, 2)).astype(np.uint32)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    runs = [
        run(device, registry, GgmlType.Q8_0, Route.DIRECT, weights, stride, x, ids, 19, 4, False, p) for p in (OFF, ON)
    ]
    assert [r[1].pipeline for r in runs] == [DIRECT_Q8, NR2]
    np.testing.assert_array_equal(runs[0][0].view(np.uint32), runs[1][0].view(np.uint32))


def test_policy_picks_only_q8_0_direct(device, registry, rng):
    """Off (the default) keeps the direct pipeline; on, Q4_0 direct and Q8_0 grouped keep theirs."""
    n, k, E = 9, 64, 3
    weights, stride, _ = stack(rng, E, n, k)
    ids = np.array([[0, 2], [1, 0]], np.uint32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    on = registry.has_kernel(NR2)
    _, receipt, dispatch = run(device, registry, GgmlType.Q8_0, Route.DIRECT, weights, stride, x, ids, n, E, False, OFF)
    assert (receipt.pipeline, dispatch.pipeline_label, dispatch.threads_per_threadgroup) == (
        DIRECT_Q8,
        DIRECT_Q8,
        (64, 1, 1),
    )
    _, receipt, _ = run(device, registry, GgmlType.Q8_0, Route.DIRECT, weights, stride, x, ids, n, E, False, ON)
    assert receipt.pipeline == (NR2 if on else DIRECT_Q8)  # CUDA: its direct pipeline
    _, receipt, _ = run(device, registry, GgmlType.Q8_0, Route.GROUPED, weights, stride, x, ids, n, E, False, ON)
    assert receipt.pipeline == Route.GROUPED.pipelines(GgmlType.Q8_0)[1]
    q4 = routemm.q4_0.quantize(rng.uniform(-1, 1, (E, n, k)).astype(np.float32)).reshape(-1)
    _, receipt, _ = run(device, registry, GgmlType.Q4_0, Route.DIRECT, q4, q4.size // E, x, ids, n, E, False, ON)
    assert receipt.pipeline == routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES[0]
    validate(receipt)
    assert type(receipt).from_json(receipt.to_json()) == receipt


def test_matmul_id_automatic_direct_route_follows_the_frozen_policy(device, rng, monkeypatch):
    """routemm.matmul_id on arrays (decode: the automatic direct route) takes the nr2 pipeline
    under a policy frozen into the registry; without one, the environment's (off by default)."""
    E, n, k = 4, 10, 96
    w = q8_0.quantize(rng.uniform(-1, 1, (E, n, k)).astype(np.float32))
    x = rng.standard_normal((2, k)).astype(np.float32)
    ids = np.array([[0, 3], [2, 1]])
    frozen = routemm.KernelRegistry(device)
    frozen.freeze_ggml_routing_policy(ON)
    has = frozen.has_kernel(NR2)
    got = {}
    for name, registry in (("default", routemm.KernelRegistry(device)), ("frozen", frozen)):
        monkeypatch.setattr(qmi, "_registry_for", lambda _device, registry=registry: registry)
        monkeypatch.setattr(dmi, "_registry_for", lambda _device, registry=registry: registry)
        got[name] = routemm.matmul_id(w, x, ids, device=device, ggml_type=GgmlType.Q8_0, return_receipt=True)
    assert got["default"][1].pipeline == DIRECT_Q8
    assert got["frozen"][1] == routemm.GgmlQuantizedMatmulIdDispatchReceipt(
        GgmlType.Q8_0, Route.DIRECT, 1, NR2 if has else DIRECT_Q8
    )
    monkeypatch.setenv("ROUTEMM_Q8_0_ID_MV_NR2", "on")
    monkeypatch.setattr(qmi, "_registry_for", lambda _device: routemm.KernelRegistry(device))
    _, receipt = routemm.matmul_id(w, x, ids, device=device, ggml_type=GgmlType.Q8_0, return_receipt=True)
    assert receipt.pipeline == (NR2 if has else DIRECT_Q8)


def test_tensor_ops_read_the_environment_once():
    """The tensor call path (matmul_id on PyTorch CPU tensors) reads ROUTEMM_Q8_0_ID_MV_NR2 once."""
    pytest.importorskip("torch")
    code = """
import numpy as np, os, torch, routemm
w = routemm.q8_0.quantize(np.ones((2, 4, 64), np.float32))
x, ids = torch.ones(1, 64), torch.tensor([[1, 0]], dtype=torch.int32)
_, r = routemm.matmul_id(torch.from_numpy(w), x, ids, ggml_type="q8_0", return_receipt=True)
os.environ["ROUTEMM_Q8_0_ID_MV_NR2"] = "0"
_, again = routemm.matmul_id(torch.from_numpy(w), x, ids, ggml_type="q8_0", return_receipt=True)
print(r.pipeline, again.pipeline)
"""
    for value, want in (("1", NR2), (" TRUE ", NR2), ("", DIRECT_Q8), ("0", DIRECT_Q8)):
        done = run_python(code, ROUTEMM_Q8_0_ID_MV_NR2=value)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [want, want], value


def test_numpy_moe_block_follows_the_frozen_policy(device, rng, monkeypatch):
    """routemm.moe_experts on arrays with Q8_0 stacks (decode: the direct route) passes the frozen
    policy's expert_q8_0_mv_nr2 to the core's op, which runs the nr2 pipeline where the backend
    has it: on the CPU with the direct pipeline's bits; in metal_emu, whose nr2 reduction order
    differs from the lane contract's at k = 1024 (32 blocks), with other bits."""
    from routemm.ops import moe

    E, h, inter, m = 2, 1024, 32, 1
    gate_up = q8_0.quantize(rng.uniform(-1, 1, (E, 2 * inter, h)).astype(np.float32))
    down = q8_0.quantize(rng.uniform(-1, 1, (E, h, inter)).astype(np.float32))
    hidden = rng.standard_normal((m, h)).astype(np.float32)
    ids, weights = np.array([[1, 0]]), np.full((m, 2), 0.5, np.float32)
    passed, out = [], {}
    real = moe._core._moe_experts

    def spy(*args, **kwargs):
        passed.append(kwargs.get("q8_0_mv_nr2"))
        return real(*args, **kwargs)

    monkeypatch.setattr(moe._core, "_moe_experts", spy)
    for on in (False, True):
        frozen = routemm.KernelRegistry(device)
        frozen.freeze_ggml_routing_policy(Policy(expert_q8_0_mv_nr2=on))
        monkeypatch.setattr(moe, "_registry_for", lambda _device, frozen=frozen: frozen)
        out[on] = routemm.moe_experts(hidden, ids, weights, gate_up, down, ggml_type=GgmlType.Q8_0, device=device)
    assert passed == [False, True]
    same = np.array_equal(out[False].view(np.uint32), out[True].view(np.uint32))
    if device.backend == "cpu":
        assert same
    elif device.backend == "metal_emu":
        assert not same
        assert np.abs(out[True] - out[False]).max() <= 1e-5 * np.abs(out[False]).max()  # F32 reordering only
