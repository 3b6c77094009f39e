"""moe_gate's routing options (vLLM's names): scoring_func, e_score_correction_bias, num_expert_group /
topk_group, renormalize, routed_scaling_factor and gpt-oss's router_bias, against a float64 reference written here (DeepSeek-V3,
Qwen / Mixtral, gpt-oss routers) on every tested backend, through NumPy and torch tensors (both torch
kernel sets, fake tensors, torch.compile), their tie rules and every refusal."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import routemm
from routemm.ops.moe import encode_moe_gate
from tolerances import MOE_GATE_TOLERANCE

ATOL, RTOL = MOE_GATE_TOLERANCE


def reference_route(
    logits, top_k, *, renormalize, scoring_func="softmax", bias=None, groups=None, topk_group=None, scale=1.0,
    router_bias=None,
):  # fmt: skip
    """(weights, ids) in float64, one row at a time, as DeepSeek-V3's gate and vLLM's grouped_topk
    write it: the router bias added to the logits (llama.cpp's gpt-oss graph), scores, biased
    selection scores, the best groups by the sum of their top-2, top-k of the kept experts (ties to
    the lower index), unbiased weights, renormalise, scale."""
    out_w, out_ids = [], []
    for row in np.asarray(logits, dtype=np.float64):
        if router_bias is not None:
            row = row + np.asarray(router_bias, dtype=np.float64)
        if scoring_func == "softmax":
            e = np.exp(row - row.max())
            scores = e / e.sum()
        else:
            scores = 1.0 / (1.0 + np.exp(-row))
        selection = scores + (0.0 if bias is None else np.asarray(bias, dtype=np.float64))
        n = len(row)
        allowed = list(range(n))
        if groups is not None:
            size = n // groups
            group_score = [sum(sorted(selection[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
            kept = sorted(range(groups), key=lambda g: (-group_score[g], g))[:topk_group]
            allowed = [e for g in sorted(kept) for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: (-selection[e], e))[:top_k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        out_w.append(w * scale)
        out_ids.append(chosen)
    return np.array(out_w), np.array(out_ids)


def gpt_oss_route(logits, top_k):
    """gpt-oss: the top-k logits, then softmax over those k only."""
    z = np.asarray(logits, dtype=np.float64)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :top_k]
    top = np.take_along_axis(z, ids, axis=1)
    e = np.exp(top - top.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True), ids


# name: (n_experts, top_k, moe_gate options); BIASED names get a random e_score_correction_bias,
# ROUTER_BIASED names a random router_bias.
ROUTERS = {
    "deepseek_v3": (64, 8, dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)),
    "deepseek_v3_one_group": (32, 4, dict(scoring_func="sigmoid", num_expert_group=1, topk_group=1)),
    "grouped_softmax": (32, 6, dict(num_expert_group=4, topk_group=3)),
    "qwen3": (128, 8, dict()),
    "qwen2_no_renormalize": (60, 4, dict()),
    "mixtral": (8, 2, dict()),
    "sigmoid_scaled": (16, 4, dict(scoring_func="sigmoid", routed_scaling_factor=0.75)),
    "groups_of_one": (8, 3, dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4)),
    "gpt_oss": (32, 4, dict()),
    "router_bias_under_every_option": (
        32, 4, dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=1.5)
    ),
}  # fmt: skip
BIASED = {"deepseek_v3", "deepseek_v3_one_group", "groups_of_one", "sigmoid_scaled", "router_bias_under_every_option"}
ROUTER_BIASED = {"gpt_oss", "router_bias_under_every_option"}
RENORMALIZED = {
    "deepseek_v3", "deepseek_v3_one_group", "grouped_softmax", "qwen3", "mixtral", "groups_of_one", "gpt_oss",
    "router_bias_under_every_option",
}  # fmt: skip


def _case(name, rng, m=23):
    n_experts, top_k, options = ROUTERS[name]
    logits = (rng.standard_normal((m, n_experts)) * 2).astype(np.float32)
    options = dict(options, renormalize=name in RENORMALIZED)
    if name in BIASED:
        options["e_score_correction_bias"] = (rng.standard_normal(n_experts) * 0.3).astype(np.float32)
    if name in ROUTER_BIASED:
        options["router_bias"] = (rng.standard_normal(n_experts) * 1.5).astype(np.float32)
    return logits, top_k, options


def _reference(logits, top_k, options):
    return reference_route(
        logits, top_k, renormalize=options["renormalize"], scoring_func=options.get("scoring_func", "softmax"),
        bias=options.get("e_score_correction_bias"), groups=options.get("num_expert_group"),
        topk_group=options.get("topk_group"), scale=options.get("routed_scaling_factor", 1.0),
        router_bias=options.get("router_bias"),
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_routers_match_the_float64_reference(device, rng, name):
    logits, top_k, options = _case(name, rng)
    weights, ids = routemm.moe_gate(logits, top_k, device=device, **options)
    want_w, want_ids = _reference(logits, top_k, options)
    assert weights.dtype == np.float32 and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, atol=ATOL * options.get("routed_scaling_factor", 1.0), rtol=RTOL)


def test_the_shared_reference_agrees(rng):
    from routemm.ops._reference import moe_gate_reference

    for name in ROUTERS:
        logits, top_k, options = _case(name, rng)
        got_w, got_ids = moe_gate_reference(logits, top_k, **options)
        want_w, want_ids = _reference(logits, top_k, options)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-12)


def test_grouping_masks_a_group_with_one_strong_expert(device):
    # Group 0 holds the strongest expert but its top-2 sum is below group 1's: only group 1 is kept.
    logits = np.array([[10.0, -10.0, 1.0, 1.0]], dtype=np.float32)
    weights, ids = routemm.moe_gate(
        logits, 2, renormalize=True, scoring_func="sigmoid", num_expert_group=2, topk_group=1, device=device
    )
    np.testing.assert_array_equal(ids, [[2, 3]])
    np.testing.assert_allclose(weights, [[0.5, 0.5]], rtol=1e-6)


def test_the_bias_selects_and_the_weights_stay_unbiased(device):
    logits = np.array([[2.0, 0.0, -1.0, 1.0]], dtype=np.float32)
    bias = np.array([0.0, 5.0, 4.0, 0.0], dtype=np.float32)
    weights, ids = routemm.moe_gate(
        logits, 2, renormalize=False, scoring_func="sigmoid", e_score_correction_bias=bias, device=device
    )
    np.testing.assert_array_equal(ids, [[1, 2]])
    np.testing.assert_allclose(weights, [[0.5, 1 / (1 + np.e)]], rtol=1e-6)


def test_softmax_with_renormalize_is_gpt_oss_softmax_over_the_selected(device, rng):
    logits = (rng.standard_normal((19, 32)) * 3).astype(np.float32)
    weights, ids = routemm.moe_gate(logits, 4, renormalize=True, device=device)
    want_w, want_ids = gpt_oss_route(logits, 4)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, atol=ATOL, rtol=RTOL)


def test_the_router_bias_moves_the_selection_and_the_weights(device):
    # The e_score_correction_bias case above with router_bias instead: the biased logits [2, 5, 3, 1]
    # select experts 1 and 2 and softmax over those two logits weighs them.
    logits = np.array([[2.0, 0.0, -1.0, 1.0]], dtype=np.float32)
    bias = np.array([0.0, 5.0, 4.0, 0.0], dtype=np.float32)
    weights, ids = routemm.moe_gate(logits, 2, renormalize=True, router_bias=bias, device=device)
    np.testing.assert_array_equal(ids, [[1, 2]])
    np.testing.assert_allclose(weights, [[1 / (1 + np.exp(-2.0)), 1 / (1 + np.exp(2.0))]], rtol=1e-6)


def test_gpt_oss_router_softmax_over_the_selected_biased_logits(device, rng):
    # llama.cpp's gpt-oss graph: logits + ffn_gate_inp.bias, top-k of those, softmax over the k.
    logits = (rng.standard_normal((19, 32)) * 3).astype(np.float32)
    bias = (rng.standard_normal(32) * 2).astype(np.float32)
    weights, ids = routemm.moe_gate(logits, 4, renormalize=True, router_bias=bias, device=device)
    want_w, want_ids = gpt_oss_route(logits.astype(np.float64) + bias, 4)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, atol=ATOL, rtol=RTOL)


def test_a_router_bias_of_zeros_keeps_the_gate_bit_for_bit(device, rng):
    logits = (rng.standard_normal((9, 16)) * 3).astype(np.float32)
    for options in (dict(), dict(scoring_func="sigmoid", e_score_correction_bias=np.full(16, 0.25, np.float32))):
        plain = routemm.moe_gate(logits, 4, renormalize=True, device=device, **options)
        zeros = routemm.moe_gate(
            logits, 4, renormalize=True, router_bias=np.zeros(16, np.float32), device=device, **options
        )
        for a, b in zip(plain, zeros, strict=True):
            np.testing.assert_array_equal(a, b)


def test_defaults_keep_the_plain_gate_bit_for_bit(device, rng):
    logits = (rng.standard_normal((9, 16)) * 3).astype(np.float32)
    logits[1, 3] = np.nan
    logits[2, :] = -np.inf
    for renormalize in (False, True):
        plain = routemm.moe_gate(logits, 4, renormalize=renormalize, device=device)
        spelled = routemm.moe_gate(
            logits, 4, renormalize=renormalize, scoring_func="softmax", e_score_correction_bias=None,
            num_expert_group=None, topk_group=None, routed_scaling_factor=1.0, router_bias=None, device=device,
        )  # fmt: skip
        for a, b in zip(plain, spelled, strict=True):
            np.testing.assert_array_equal(a, b)


# ---- ties: the lower index wins, for groups and experts ------------------------------------------


def test_tied_biased_scores_go_to_the_lower_expert(device):
    logits = np.zeros((1, 6), dtype=np.float32)
    bias = np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=np.float32)
    weights, ids = routemm.moe_gate(
        logits, 2, renormalize=True, scoring_func="sigmoid", e_score_correction_bias=bias,
        routed_scaling_factor=2.0, device=device,
    )  # fmt: skip
    np.testing.assert_array_equal(ids, [[1, 2]])
    np.testing.assert_array_equal(weights, [[1.0, 1.0]])


def test_tied_groups_go_to_the_lower_group(device):
    # Groups 1 and 3 tie for best (same two scores); topk_group = 1 keeps group 1.
    logits = np.array([[-5.0, -5.0, 1.0, 2.0, -5.0, -5.0, 2.0, 1.0]], dtype=np.float32)
    _, ids = routemm.moe_gate(
        logits, 2, renormalize=True, scoring_func="sigmoid", num_expert_group=4, topk_group=1, device=device
    )
    np.testing.assert_array_equal(ids, [[3, 2]])
    # Every group ties: the lowest topk_group groups are kept, their experts in index order.
    _, ids = routemm.moe_gate(
        np.zeros((1, 8), np.float32), 3, renormalize=False, num_expert_group=4, topk_group=2, device=device
    )
    np.testing.assert_array_equal(ids, [[0, 1, 2]])


def test_a_row_without_mass_takes_the_lowest_kept_experts(device):
    # Softmax of a row of -inf: scores 0, groups tie, ids the lowest of the kept groups, weights 0.
    logits = np.full((1, 8), -np.inf, dtype=np.float32)
    weights, ids = routemm.moe_gate(logits, 3, renormalize=True, num_expert_group=4, topk_group=2, device=device)
    np.testing.assert_array_equal(ids, [[0, 1, 2]])
    np.testing.assert_array_equal(weights, np.zeros((1, 3), np.float32))


# ---- refusals -------------------------------------------------------------------------------------

# (options, message) refused by every front door with the same message (torch's dtype repr aside).
REFUSALS = [
    (dict(num_expert_group=3, topk_group=1), r"moe_gate num_expert_group 3 must divide n_experts = 8"),
    (dict(num_expert_group=4, topk_group=5), r"moe_gate topk_group 5 must be in \[1, num_expert_group = 4\]"),
    (dict(num_expert_group=4, topk_group=0), r"moe_gate topk_group must be None or a positive integer, got 0"),
    (dict(num_expert_group=-2, topk_group=1), r"moe_gate num_expert_group must be None or a positive integer, got -2"),
    (dict(num_expert_group=4), r"moe_gate num_expert_group and topk_group must be given together, got 4 and None"),
    (dict(topk_group=2), r"moe_gate num_expert_group and topk_group must be given together, got None and 2"),
    (dict(top_k=5, num_expert_group=4, topk_group=2), r"moe_gate top_k 5 exceeds the 4 experts of the topk_group = 2"),
    (dict(scoring_func="relu"), r"moe_gate scoring_func must be 'softmax' or 'sigmoid', got 'relu'"),
    (dict(routed_scaling_factor=float("inf")), r"moe_gate routed_scaling_factor must be finite as a float32, got inf"),
    (dict(routed_scaling_factor=float("nan")), r"moe_gate routed_scaling_factor must be finite as a float32, got nan"),
    (dict(routed_scaling_factor=1e39), r"moe_gate routed_scaling_factor must be finite as a float32, got 1e\+39"),
    (dict(bias_shape=(4,)), r"moe_gate e_score_correction_bias must have shape \(n_experts,\) = \(8,\), got \(4,\)"),
    (dict(bias_shape=(1, 8)), r"e_score_correction_bias must have shape \(n_experts,\) = \(8,\), got \(1, 8\)"),
    (dict(bias_dtype="float64"), r"moe_gate e_score_correction_bias must be float32, got (torch\.)?float64"),
    (dict(router_bias_shape=(4,)), r"moe_gate router_bias must have shape \(n_experts,\) = \(8,\), got \(4,\)"),
    (dict(router_bias_shape=(1, 8)), r"moe_gate router_bias must have shape \(n_experts,\) = \(8,\), got \(1, 8\)"),
    (dict(router_bias_dtype="float64"), r"moe_gate router_bias must be float32, got (torch\.)?float64"),
]


def _refusal_args(options, make_bias):
    options = dict(options)
    top_k = options.pop("top_k", 2)
    for prefix, name in (("bias", "e_score_correction_bias"), ("router_bias", "router_bias")):
        shape, dtype = options.pop(f"{prefix}_shape", None), options.pop(f"{prefix}_dtype", None)
        if shape is not None or dtype is not None:
            options[name] = make_bias(shape or (8,), dtype or "float32")
    return top_k, options


@pytest.mark.parametrize("options, message", REFUSALS)
def test_numpy_refusals_name_the_argument(device, options, message):
    top_k, options = _refusal_args(options, lambda shape, dtype: np.zeros(shape, dtype))
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.moe_gate(np.zeros((3, 8), np.float32), top_k, renormalize=True, device=device, **options)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_expert_group=True, topk_group=1), "num_expert_group must be None or a positive integer, got True"),
        (dict(num_expert_group=4, topk_group=2.0), "topk_group must be None or a positive integer, got 2.0"),
        (dict(num_expert_group=2**32, topk_group=1), "num_expert_group must be a u32, got 4294967296"),
        (dict(scoring_func=1), "scoring_func must be 'softmax' or 'sigmoid', got 1"),
        (dict(scoring_func="Sigmoid"), "scoring_func must be 'softmax' or 'sigmoid', got 'Sigmoid'"),
        (dict(routed_scaling_factor="2"), "routed_scaling_factor must be a real number, got '2'"),
        (dict(routed_scaling_factor=True), "routed_scaling_factor must be a real number, got True"),
        (dict(e_score_correction_bias=[0.0] * 8), "e_score_correction_bias must be a NumPy array for NumPy logits"),
        (dict(router_bias=[0.0] * 8), "moe_gate router_bias must be a NumPy array for NumPy logits, got list"),
    ],
)
def test_numpy_refuses_coercions(device, options, message):
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.moe_gate(np.zeros((3, 8), np.float32), 2, renormalize=True, device=device, **options)


@pytest.mark.parametrize("options, message", REFUSALS)
def test_a_refused_encode_writes_nothing(device, registry, options, message):
    # Buffers: a float16 bias stands for a wrong dtype; the core checks a bias buffer's bytes and shape.
    top_k, options = _refusal_args(
        options, lambda shape, dtype: device.from_numpy(np.zeros(shape, np.float16 if dtype != "float32" else dtype))
    )
    for name in ("e_score_correction_bias", "router_bias"):
        if name in options:
            message = {
                (4,): rf"moe_gate {name} requires 32 logical bytes, got 16",
                (1, 8): rf"moe_gate {name} must have shape \[n_experts = 8\], got \[1, 8\]",
            }.get(tuple(options[name].shape), f"moe_gate {name} must be f32, got f16")
    logits = device.from_numpy(np.zeros((3, 8), np.float32))
    weights = device.from_numpy(np.full((3, top_k), 7.0, np.float32))
    ids = device.from_numpy(np.full((3, top_k), 9, np.int32))
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        encode_moe_gate(encoder, registry, logits, weights, ids, top_k=top_k, renormalize=True, **options)
    encoder.commit_and_wait()
    assert (weights.numpy() == 7.0).all() and (ids.numpy() == 9).all()


@pytest.mark.parametrize("name", ["deepseek_v3", "router_bias_under_every_option"])
def test_encode_with_bias_buffers(device, registry, rng, name):
    logits, top_k, options = _case(name, rng, m=5)
    buffers = {k: device.from_numpy(options.pop(k)) for k in ("e_score_correction_bias", "router_bias") if k in options}
    weights = device.alloc(5 * top_k * 4, routemm.DType.F32, [5, top_k])
    ids = device.alloc(5 * top_k * 4, routemm.DType.U32, [5, top_k])
    encoder = device.command_encoder()
    encode_moe_gate(encoder, registry, device.from_numpy(logits), weights, ids, top_k=top_k, **buffers, **options)
    encoder.commit_and_wait()
    want_w, want_ids = _reference(logits, top_k, dict(options, **{k: b.numpy() for k, b in buffers.items()}))
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(weights.numpy(), want_w, atol=ATOL * 2.5, rtol=RTOL)


def test_encode_refuses_a_router_bias_overlapping_an_output(device, registry):
    logits = device.from_numpy(np.zeros((1, 8), np.float32))
    shared = device.from_numpy(np.zeros(8, np.float32))
    ids = device.alloc(8, routemm.DType.I32, [1, 2])
    weights = shared.view(0, 8, routemm.DType.F32, [1, 2])  # the router bias's first two floats
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate output must not overlap router_bias"):
        encode_moe_gate(encoder, registry, logits, weights, ids, top_k=2, renormalize=True, router_bias=shared)
    encoder.commit_and_wait()


# ---- torch tensors -------------------------------------------------------------------------------

HAVE_TORCH = importlib.util.find_spec("torch") is not None
torch_tests = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
# CPU, and CUDA where torch and routemm have a GPU (torch_devices.py; imported only with torch).
TORCH_DEVICES = __import__("torch_devices").torch_devices() if HAVE_TORCH else ["cpu"]


def _torch_args(name, rng, tdev):
    import torch

    logits, top_k, options = _case(name, rng)
    bias = options.get("e_score_correction_bias")
    op_args = (
        options.get("scoring_func", "softmax"),
        None if bias is None else torch.from_numpy(bias).to(tdev),
        options.get("num_expert_group"),
        options.get("topk_group"),
        options.get("routed_scaling_factor", 1.0),
        None if "router_bias" not in options else torch.from_numpy(options["router_bias"]).to(tdev),
    )
    return torch.from_numpy(logits).to(tdev), top_k, options, op_args


@torch_tests
@pytest.mark.parametrize("torch_device", TORCH_DEVICES)
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_torch_op_both_kernel_sets_and_front_door_agree(torch_device, rng, name):
    import routemm.torch as rt
    import torch

    logits, top_k, options, op_args = _torch_args(name, rng, torch_device)
    renormalize = options["renormalize"]
    weights, ids = torch.ops.routemm.moe_gate(logits, top_k, renormalize, *op_args)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and weights.device == logits.device
    python_w, python_ids = rt._moe_gate(logits, top_k, renormalize, *op_args)
    assert torch.equal(python_w, weights) and torch.equal(python_ids, ids)
    tensor_options = dict(options)
    if op_args[1] is not None:
        tensor_options["e_score_correction_bias"] = op_args[1]
    if op_args[5] is not None:
        tensor_options["router_bias"] = op_args[5]
    front_w, front_ids = routemm.moe_gate(logits, top_k, **tensor_options)
    assert torch.equal(front_w, weights) and torch.equal(front_ids, ids)
    want_w, want_ids = _reference(logits.cpu().numpy(), top_k, options)
    np.testing.assert_array_equal(ids.cpu().numpy(), want_ids)
    np.testing.assert_allclose(
        weights.cpu().numpy(), want_w, atol=ATOL * options.get("routed_scaling_factor", 1.0), rtol=RTOL
    )
    if logits.device.type == "cpu":  # the NumPy front door on the CPU backend: the same bits
        np_w, np_ids = routemm.moe_gate(logits.numpy(), top_k, device="cpu", **options)
        assert np.array_equal(np_w, weights.numpy()) and np.array_equal(np_ids, ids.numpy())


@torch_tests
@pytest.mark.parametrize("options, message", REFUSALS)
def test_torch_kernel_sets_refuse_with_the_same_message(options, message):
    import routemm.torch as rt
    import torch

    top_k, options = _refusal_args(options, lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype)))
    args = (
        options.get("scoring_func", "softmax"),
        options.get("e_score_correction_bias"),
        options.get("num_expert_group"),
        options.get("topk_group"),
        options.get("routed_scaling_factor", 1.0),
        options.get("router_bias"),
    )
    logits = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=message) as from_op:
        torch.ops.routemm.moe_gate(logits, top_k, True, *args)
    with pytest.raises(routemm.InvalidArgumentError) as from_python:
        rt._moe_gate(logits, top_k, True, *args)
    assert str(from_op.value) == str(from_python.value)
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.moe_gate(logits, top_k, renormalize=True, **options)


@torch_tests
def test_a_numpy_bias_for_torch_logits_is_refused():
    import torch

    logits = torch.zeros(3, 8)
    with pytest.raises(routemm.InvalidArgumentError, match="e_score_correction_bias must be one too"):
        routemm.moe_gate(logits, 2, renormalize=True, e_score_correction_bias=np.zeros(8, np.float32))
    with pytest.raises(routemm.InvalidArgumentError, match="router_bias must be one too"):
        routemm.moe_gate(logits, 2, renormalize=True, router_bias=np.zeros(8, np.float32))


@torch_tests
def test_torch_schema_appends_the_options_with_defaults():
    import routemm.torch  # noqa: F401
    import torch

    schema = torch.ops.routemm.moe_gate.default._schema
    names = [a.name for a in schema.arguments]
    assert names == [
        "router_logits", "top_k", "renormalize", "scoring_func", "e_score_correction_bias", "num_expert_group",
        "topk_group", "routed_scaling_factor", "router_bias",
    ]  # fmt: skip
    assert [a.default_value for a in schema.arguments[3:]] == ["softmax", None, None, None, 1.0, None]


@torch_tests
def test_fake_tensors_and_torch_compile_fullgraph_with_the_options(rng):
    import routemm.torch  # noqa: F401
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, top_k, options, op_args = _torch_args("deepseek_v3", rng, "cpu")
    router_bias = torch.randn(64, generator=torch.Generator().manual_seed(1))
    with FakeTensorMode() as mode:
        fake_args = (op_args[0], mode.from_tensor(op_args[1]), *op_args[2:5], mode.from_tensor(router_bias))
        w, ids = torch.ops.routemm.moe_gate(mode.from_tensor(logits), top_k, True, *fake_args)
    assert (w.shape, w.dtype, ids.shape, ids.dtype) == ((23, top_k), torch.float32, (23, top_k), torch.int32)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"e_score_correction_bias must have shape"):
        torch.ops.routemm.moe_gate(mode.from_tensor(logits), top_k, True, "sigmoid", mode.from_tensor(torch.zeros(4)))
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"moe_gate router_bias must have shape"):
        torch.ops.routemm.moe_gate(mode.from_tensor(logits), top_k, True, router_bias=mode.from_tensor(torch.zeros(4)))

    def route(x, bias, router_bias):
        return torch.ops.routemm.moe_gate(
            x, top_k, True, scoring_func="sigmoid", e_score_correction_bias=bias, num_expert_group=8, topk_group=4,
            routed_scaling_factor=2.5, router_bias=router_bias,
        )  # fmt: skip

    compiled = torch.compile(route, fullgraph=True)
    eager = route(logits, op_args[1], router_bias)
    assert all(torch.equal(a, b) for a, b in zip(compiled(logits, op_args[1], router_bias), eager, strict=True))
    assert not torch.equal(eager[1], route(logits, op_args[1], None)[1])  # the router bias reaches the kernel


@torch_tests
def test_a_bias_that_requires_grad_is_named_at_backward():
    import routemm.torch  # noqa: F401
    import torch

    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8, requires_grad=True)
    weights, _ = torch.ops.routemm.moe_gate(logits, 2, True, "sigmoid", bias, None, None, 1.0)
    with pytest.raises(routemm.UnsupportedError, match="has no gradient.*e_score_correction_bias"):
        weights.sum().backward()
    weights, _ = routemm.moe_gate(logits, 2, renormalize=True, scoring_func="sigmoid", e_score_correction_bias=bias)
    with pytest.raises(routemm.UnsupportedError, match="has no gradient.*e_score_correction_bias"):
        weights.sum().backward()
    router_bias = torch.zeros(8, requires_grad=True)
    weights, _ = torch.ops.routemm.moe_gate(logits, 2, True, router_bias=router_bias)
    with pytest.raises(routemm.UnsupportedError, match="has no gradient.*router_bias"):
        weights.sum().backward()
    weights, _ = routemm.moe_gate(logits, 2, renormalize=True, router_bias=router_bias)
    with pytest.raises(routemm.UnsupportedError, match="has no gradient.*router_bias"):
        weights.sum().backward()


# ---- MoeLayer ------------------------------------------------------------------------------------


def _layer_parts(device, rng, n_experts=16, hidden=32, intermediate=24):
    def put(shape, scale):
        return device.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))

    return (
        put((n_experts, hidden), 1.0),
        put((n_experts, intermediate, hidden), hidden**-0.5),
        put((n_experts, intermediate, hidden), hidden**-0.5),
        put((n_experts, hidden, intermediate), intermediate**-0.5),
    )


def test_moe_layer_routes_with_the_options(device, rng):
    from routemm.ops._reference import dense_matmul_id_reference, moe_experts_reference

    parts = _layer_parts(device, rng)
    bias = (rng.standard_normal(16) * 0.3).astype(np.float32)
    options = dict(
        scoring_func="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5, renormalize=True
    )
    layer = routemm.MoeLayer(*parts, top_k=4, e_score_correction_bias=device.from_numpy(bias), **options)
    hidden = rng.standard_normal((7, 32)).astype(np.float32)
    out = layer(hidden)
    w = layer.float_weights()
    logits = dense_matmul_id_reference(w["router"][None], hidden, np.zeros((7, 1), np.int64))
    want_w, want_ids = _reference(logits, 4, dict(options, e_score_correction_bias=bias))
    _, ids, _ = layer.reference(hidden)
    np.testing.assert_array_equal(ids, want_ids)
    want = moe_experts_reference(hidden, want_ids, want_w, w["gate"], w["up"], w["down"])
    np.testing.assert_allclose(out, want, atol=5e-5, rtol=5e-5)
    plain = routemm.MoeLayer(*parts, top_k=4, renormalize=True)
    assert not np.array_equal(plain(hidden), out)  # the options reach the gate


def test_moe_layer_adds_the_router_bias_to_its_logits(device, rng):
    from routemm.ops._reference import dense_matmul_id_reference, moe_experts_reference

    parts = _layer_parts(device, rng)
    router_bias = (rng.standard_normal(16) * 2).astype(np.float32)
    layer = routemm.MoeLayer(*parts, top_k=4, renormalize=True, router_bias=device.from_numpy(router_bias))
    hidden = rng.standard_normal((7, 32)).astype(np.float32)
    out = layer(hidden)
    w = layer.float_weights()
    logits = dense_matmul_id_reference(w["router"][None], hidden, np.zeros((7, 1), np.int64))
    want_w, want_ids = gpt_oss_route(logits + router_bias, 4)
    _, ids, ranked = layer.reference(hidden)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(ranked, logits + router_bias, rtol=1e-12)  # the logits the gate ranks
    want = moe_experts_reference(hidden, want_ids, want_w, w["gate"], w["up"], w["down"])
    np.testing.assert_allclose(out, want, atol=5e-5, rtol=5e-5)
    plain = routemm.MoeLayer(*parts, top_k=4, renormalize=True)
    assert not np.array_equal(plain.reference(hidden)[1], want_ids)  # the bias moves the routes


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_expert_group=3, topk_group=1), "moe_gate num_expert_group 3 must divide n_experts = 16"),
        (dict(num_expert_group=4), "moe layer: num_expert_group and topk_group must be given together"),
        (dict(num_expert_group=8, topk_group=1), "moe_gate top_k 4 exceeds the 2 experts"),
        (dict(scoring_func="tanh"), "moe_gate scoring_func must be 'softmax' or 'sigmoid', got 'tanh'"),
        (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be finite as a float32, got inf"),
        (dict(e_score_correction_bias=np.zeros(16, np.float32)), "e_score_correction_bias must be a Buffer or None"),
        (dict(e_score_correction_bias="f16"), r"moe layer: e_score_correction_bias must be f32 \[16\], got f16 \[16\]"),
        (
            dict(e_score_correction_bias="short"),
            r"moe layer: e_score_correction_bias must be f32 \[16\], got f32 \[8\]",
        ),
        (dict(router_bias=np.zeros(16, np.float32)), "moe layer: router_bias must be a Buffer or None"),
        (dict(router_bias="f16"), r"moe layer: router_bias must be f32 \[16\], got f16 \[16\]"),
        (dict(router_bias="short"), r"moe layer: router_bias must be f32 \[16\], got f32 \[8\]"),
        (dict(router_bias="2-D"), r"moe layer: router_bias must be f32 \[16\], got f32 \[1, 16\]"),
    ],
)
def test_moe_layer_refuses_bad_routing(device, rng, options, message):
    options = dict(options)
    made = {
        "f16": lambda: device.from_numpy(np.zeros(16, np.float16)),
        "short": lambda: device.from_numpy(np.zeros(8, np.float32)),
        "2-D": lambda: device.from_numpy(np.zeros((1, 16), np.float32)),
    }
    for name in ("e_score_correction_bias", "router_bias"):
        if isinstance(options.get(name), str):
            options[name] = made[options[name]]()
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.MoeLayer(*_layer_parts(device, rng), top_k=4, renormalize=True, **options)


def test_moe_layer_refuses_a_router_bias_on_another_device(backend, rng):
    others = [b for b in routemm.available_backends() if b != backend]
    if not others:
        pytest.skip("one backend here")
    device = routemm.Device(backend)
    bias = routemm.Device(others[0]).from_numpy(np.zeros(16, np.float32))
    with pytest.raises(routemm.InvalidArgumentError, match=f"moe layer: router_bias lives on {others[0]}"):
        routemm.MoeLayer(*_layer_parts(device, rng), top_k=4, renormalize=True, router_bias=bias)
