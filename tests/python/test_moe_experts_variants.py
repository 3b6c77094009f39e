"""The experts block as real checkpoints compute it: routemm.moe_experts and
torch.ops.routemm.moe_experts with activation="swiglu_oai" (gpt-oss), expert biases,
weights_before_ffn (Llama-4) and a shared expert (DeepSeek without a gate, Qwen2-MoE with a
sigmoid gate), each against a float64 reference written here, on every tested backend, for float
and Q4_0 / Q8_0 stacks; the options' refusals; their gradients on the torch path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from tolerances import MOE_EXPERTS_TOLERANCE

ATOL, RTOL = MOE_EXPERTS_TOLERANCE
E, H, I, TOP_K, M = 6, 64, 32, 2, 9  # noqa: E741
ALPHA, LIMIT = 1.702, 7.0
CODECS = {"q4_0": routemm.q4_0, "q8_0": routemm.q8_0}


# ---- the float64 reference -------------------------------------------------------------------------


def _silu(g, u):
    return g / (1.0 + np.exp(-g)) * u


def _swiglu_oai(g, u, alpha=ALPHA, limit=LIMIT):
    # gpt-oss (torch/model.py swiglu) on the de-interleaved halves: gate clamped above only.
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return g * (1.0 / (1.0 + np.exp(-alpha * g))) * (u + 1.0)


def reference(
    x,
    ids,
    weights,
    gate,
    up,
    down,
    *,
    act=_silu,
    gate_bias=None,
    up_bias=None,
    down_bias=None,
    before=False,
    shared=None,
):
    """Token by token, slot by slot, in float64. gate/up [E, I, H], down [E, H, I]; shared:
    (gate [I_s, H], up [I_s, H], down [H, I_s], gate_vector [H] or None)."""
    x = np.asarray(x, np.float64)
    f = [np.asarray(a, np.float64) if a is not None else None for a in (gate, up, down, gate_bias, up_bias, down_bias)]
    gate, up, down, gate_bias, up_bias, down_bias = f
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if not 0 <= e < gate.shape[0]:
                continue
            w = float(weights[t, s])
            xin = w * x[t] if before else x[t]
            g, u = gate[e] @ xin, up[e] @ xin
            if gate_bias is not None:
                g, u = g + gate_bias[e], u + up_bias[e]
            y = down[e] @ act(g, u)
            if down_bias is not None:
                y = y + down_bias[e]
            out[t] += y if before else w * y
    if shared is not None:
        sg, su, sd, sv = (None if a is None else np.asarray(a, np.float64) for a in shared)
        for t in range(x.shape[0]):
            scale = 1.0 if sv is None else 1.0 / (1.0 + np.exp(-(x[t] @ sv)))
            out[t] += scale * (sd @ act(sg @ x[t], su @ x[t]))
    return out


# ---- inputs --------------------------------------------------------------------------------------


def _routing(seed=1, m=M, top_k=TOP_K):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:top_k] for _ in range(m)]).astype(np.int32)
    if m > 2 and top_k > 1:
        ids[1, 1] = -1  # an invalid id
        ids[2, 0] = E  # an expert-parallel sentinel
    weights = rng.uniform(0.1, 1.0, (m, top_k)).astype(np.float32)
    return x, ids, weights


def _stacks(seed=0, scale=1.0):
    """gate, up [E, I, H], down [E, H, I] float32; scale widens the gate/up products (swiglu_oai's
    clamps then bind)."""
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal((E, I, H)) * scale / H**0.5).astype(np.float32)
    up = (rng.standard_normal((E, I, H)) * scale / H**0.5).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) / I**0.5).astype(np.float32)
    return gate, up, down


def _biases(seed=2):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((E, I), (E, I), (E, H)))


def _close(got, want, atol=ATOL, rtol=RTOL):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol)


# ---- NumPy path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
def test_swiglu_oai_matches_reference_and_clamps(device, split):
    gate, up, down = _stacks(scale=6.0)  # products well past +-7: both clamps bind
    x, ids, weights = _routing()
    gate_up = (gate, up) if split else np.concatenate([gate, up], axis=1)
    got = routemm.moe_experts(x, ids, weights, gate_up, down, activation="swiglu_oai", device=device)
    want = reference(x, ids, weights, gate, up, down, act=_swiglu_oai)
    _close(got, want)
    # The clamps matter on these inputs: without them the result is far from this one.
    unclamped = reference(x, ids, weights, gate, up, down, act=lambda g, u: _swiglu_oai(g, u, limit=np.inf))
    assert np.max(np.abs(unclamped - want)) > 1.0


def test_swiglu_oai_alpha_and_limit_options(device):
    gate, up, down = _stacks(scale=3.0)
    x, ids, weights = _routing()
    gate_up = np.concatenate([gate, up], axis=1)
    got = routemm.moe_experts(
        x, ids, weights, gate_up, down, activation="swiglu_oai", swiglu_alpha=1.0, swiglu_limit=2.5, device=device
    )
    want = reference(x, ids, weights, gate, up, down, act=lambda g, u: _swiglu_oai(g, u, 1.0, 2.5))
    _close(got, want)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("split", [False, True])
def test_expert_biases(device, split, activation):
    gate, up, down = _stacks(scale=2.0)
    gb, ub, db = _biases()
    x, ids, weights = _routing()
    if split:
        gate_up, kw = (gate, up), {"gate_bias": gb, "up_bias": ub}
    else:
        gate_up, kw = np.concatenate([gate, up], axis=1), {"gate_up_bias": np.concatenate([gb, ub], axis=1)}
    got = routemm.moe_experts(x, ids, weights, gate_up, down, activation=activation, down_bias=db, device=device, **kw)
    act = _swiglu_oai if activation == "swiglu_oai" else _silu
    want = reference(x, ids, weights, gate, up, down, act=act, gate_bias=gb, up_bias=ub, down_bias=db)
    _close(got, want)
    # Only the down bias: the gate/up products take none.
    got = routemm.moe_experts(x, ids, weights, gate_up, down, activation=activation, down_bias=db, device=device)
    _close(got, reference(x, ids, weights, gate, up, down, act=act, down_bias=db))


@pytest.mark.parametrize("top_k", [1, 2])
def test_weights_before_ffn(device, top_k):
    gate, up, down = _stacks()
    x, ids, weights = _routing(top_k=top_k)
    gate_up = np.concatenate([gate, up], axis=1)
    got = routemm.moe_experts(x, ids, weights, gate_up, down, weights_before_ffn=True, device=device)
    want = reference(x, ids, weights, gate, up, down, before=True)
    _close(got, want)
    # SiLU is not linear: weighing before and after differ on these inputs.
    assert np.max(np.abs(want - reference(x, ids, weights, gate, up, down))) > 1e-2


def test_every_option_at_once_with_a_gated_shared_expert(device):
    gate, up, down = _stacks(scale=2.0)
    gb, ub, db = _biases()
    rng = np.random.default_rng(5)
    i_s = 48  # the shared expert's own width
    sg, su = (rng.standard_normal((i_s, H)).astype(np.float32) / H**0.5 for _ in range(2))
    sd = rng.standard_normal((H, i_s)).astype(np.float32) / i_s**0.5
    sv = rng.standard_normal(H).astype(np.float32) / H**0.5
    x, ids, weights = _routing()
    got = routemm.moe_experts(
        x, ids, weights, (gate, up), down, activation="swiglu_oai", gate_bias=gb, up_bias=ub, down_bias=db,
        weights_before_ffn=True, shared_gate_up=np.concatenate([sg, su]), shared_down=sd, shared_gate=sv,
        device=device,
    )  # fmt: skip
    want = reference(
        x, ids, weights, gate, up, down, act=_swiglu_oai, gate_bias=gb, up_bias=ub, down_bias=db, before=True,
        shared=(sg, su, sd, sv),
    )  # fmt: skip
    _close(got, want)


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert(device, gated):
    gate, up, down = _stacks()
    rng = np.random.default_rng(6)
    sg, su = (rng.standard_normal((I, H)).astype(np.float32) / H**0.5 for _ in range(2))
    sd = rng.standard_normal((H, I)).astype(np.float32) / I**0.5
    sv = rng.standard_normal((1, H)).astype(np.float32) if gated else None
    x, ids, weights = _routing()
    got = routemm.moe_experts(
        x, ids, weights, np.concatenate([gate, up], axis=1), down, shared_gate_up=(sg, su), shared_down=sd,
        shared_gate=sv, device=device,
    )  # fmt: skip
    want = reference(x, ids, weights, gate, up, down, shared=(sg, su, sd, None if sv is None else sv[0]))
    _close(got, want)
    routed = routemm.moe_experts(x, ids, weights, np.concatenate([gate, up], axis=1), down, device=device)
    assert np.max(np.abs(got - routed)) > 1e-2


@pytest.mark.parametrize("wdtype", ["f16", "bf16"])
def test_half_stacks_with_every_option(device, wdtype):
    np_dtype = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}[wdtype]
    gate, up, down = (a.astype(np_dtype) for a in _stacks(scale=2.0))
    gb, ub, db = _biases()
    x, ids, weights = _routing()
    got = routemm.moe_experts(
        x, ids, weights, np.concatenate([gate, up], axis=1), down, activation="swiglu_oai",
        gate_up_bias=np.concatenate([gb, ub], axis=1), down_bias=db, weights_before_ffn=True, device=device,
    )  # fmt: skip
    want = reference(
        x, ids, weights, gate, up, down, act=_swiglu_oai, gate_bias=gb, up_bias=ub, down_bias=db, before=True
    )
    _close(got, want)


@pytest.mark.parametrize("ggml_type", ["q4_0", "q8_0"])
def test_block_stacks_with_every_option(device, ggml_type):
    codec = CODECS[ggml_type]
    gate, up, down = _stacks(scale=2.0)
    q = [codec.quantize(a) for a in (gate, up, down)]
    deq = [codec.dequantize(b, a.shape) for b, a in zip(q, (gate, up, down), strict=True)]
    gb, ub, db = _biases()
    x, ids, weights = _routing()
    rng = np.random.default_rng(7)
    shared = [rng.standard_normal(shape).astype(np.float32) / 8 for shape in ((I, H), (I, H), (H, I))]
    q_shared = [codec.quantize(a) for a in shared]
    deq_shared = [codec.dequantize(b, a.shape) for b, a in zip(q_shared, shared, strict=True)]
    got = routemm.moe_experts(
        x, ids, weights, (q[0], q[1]), q[2], ggml_type=ggml_type, activation="swiglu_oai", gate_bias=gb,
        up_bias=ub, down_bias=db, weights_before_ffn=True, shared_gate_up=(q_shared[0], q_shared[1]),
        shared_down=q_shared[2], device=device,
    )  # fmt: skip
    want = reference(
        x, ids, weights, *deq, act=_swiglu_oai, gate_bias=gb, up_bias=ub, down_bias=db, before=True,
        shared=(*deq_shared, None),
    )  # fmt: skip
    # Q8_0 rounds each input row to int8 blocks on the CPU's int8 routes; the float reference of the
    # dequantised weights bounds the rest.
    _close(got, want, atol=5e-2, rtol=5e-2)


def test_defaults_are_todays_block(device):
    gate, up, down = _stacks()
    x, ids, weights = _routing()
    gate_up = np.concatenate([gate, up], axis=1)
    plain = routemm.moe_experts(x, ids, weights, gate_up, down, device=device)
    explicit = routemm.moe_experts(
        x, ids, weights, gate_up, down, activation="silu", weights_before_ffn=False, device=device
    )
    np.testing.assert_array_equal(plain, explicit)
    _close(plain, reference(x, ids, weights, gate, up, down))


def test_options_are_bit_reproducible(device):
    gate, up, down = _stacks(scale=3.0)
    gb, ub, db = _biases()
    x, ids, weights = _routing()
    kw = dict(activation="swiglu_oai", gate_bias=gb, up_bias=ub, down_bias=db, weights_before_ffn=True)
    a = routemm.moe_experts(x, ids, weights, (gate, up), down, device=device, **kw)
    b = routemm.moe_experts(x, ids, weights, (gate, up), down, device=device, **kw)
    np.testing.assert_array_equal(a, b)


def test_options_keep_direct_and_grouped_bit_identical(device):
    """The options live in the activation and combine kernels, which every route shares: the exact
    direct and grouped_prefill routes of float stacks give the same bits with them."""
    gate, up, down = _stacks(scale=3.0)
    gb, ub, db = _biases()
    x, ids, weights = _routing(m=24)
    kw = dict(activation="swiglu_oai", gate_bias=gb, up_bias=ub, down_bias=db, weights_before_ffn=True, device=device)
    direct = routemm.moe_experts(x, ids, weights, (gate, up), down, route="direct", **kw)
    grouped = routemm.moe_experts(x, ids, weights, (gate, up), down, route="grouped_prefill", **kw)
    np.testing.assert_array_equal(direct, grouped)


# ---- refusals ------------------------------------------------------------------------------------


def _refusal_cases():
    gate, up, down = _stacks()
    gate_up = np.concatenate([gate, up], axis=1)
    gb, ub, db = _biases()
    gub = np.concatenate([gb, ub], axis=1)
    sg = np.zeros((I, H), np.float32)
    sd = np.zeros((H, I), np.float32)
    return [
        ("unknown activation", gate_up, {"activation": "gelu"}, "activation must be one of"),
        ("activation not a str", gate_up, {"activation": 1}, "activation must be one of"),
        ("alpha nan", gate_up, {"activation": "swiglu_oai", "swiglu_alpha": float("nan")}, "swiglu_alpha must be finite"),
        ("alpha str", gate_up, {"swiglu_alpha": "1.7"}, "swiglu_alpha must be a real number"),
        ("limit zero", gate_up, {"activation": "swiglu_oai", "swiglu_limit": 0.0}, r"swiglu_limit must be > 0"),
        ("limit nan", gate_up, {"swiglu_limit": float("nan")}, r"swiglu_limit must be > 0"),
        ("before not bool", gate_up, {"weights_before_ffn": 1}, "weights_before_ffn must be a bool"),
        ("gate_up_bias shape", gate_up, {"gate_up_bias": gb}, r"gate_up_bias must be \[6, 64\]"),
        ("gate_up_bias dtype", gate_up, {"gate_up_bias": gub.astype(np.float64)}, "gate_up_bias must be float32"),
        ("split biases on one stack", gate_up, {"gate_bias": gb, "up_bias": ub}, "gate_bias/up_bias go with"),
        ("one bias on split", (gate, up), {"gate_up_bias": gub}, "gate_up_bias goes with one gate_up stack"),
        ("gate_bias alone", (gate, up), {"gate_bias": gb}, "gate_bias and up_bias come together"),
        ("up_bias shape", (gate, up), {"gate_bias": gb, "up_bias": gub}, r"up_bias must be \[6, 32\]"),
        ("down_bias shape", gate_up, {"down_bias": gb}, r"down_bias must be \[6, 64\]"),
        ("shared down missing", gate_up, {"shared_gate_up": np.concatenate([sg, sg])}, "come together"),
        ("shared gate alone", gate_up, {"shared_gate": np.zeros(H, np.float32)}, "shared_gate needs"),
        ("shared 3-D", gate_up, {"shared_gate_up": gate_up, "shared_down": sd}, "shared_gate_up must be a 2-D"),
        ("shared width", gate_up, {"shared_gate_up": np.zeros((2 * I, H + 1), np.float32), "shared_down": sd},
         "moe_experts gate_up must be"),
        ("shared gate shape", gate_up,
         {"shared_gate_up": np.concatenate([sg, sg]), "shared_down": sd, "shared_gate": np.zeros(H + 1, np.float32)},
         r"shared_gate must be a float vector \[64\]"),
        ("shared dtype", gate_up,
         {"shared_gate_up": np.concatenate([sg, sg]).astype(np.float16), "shared_down": sd.astype(np.float16)},
         "weights must share one of"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "gate_up", "kwargs", "match"), _refusal_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_option_refusals(device, case, gate_up, kwargs, match):
    del case
    _, _, down = _stacks()
    x, ids, weights = _routing()
    with pytest.raises(routemm.InvalidArgumentError, match=match):
        routemm.moe_experts(x, ids, weights, gate_up, down, device=device, **kwargs)


def test_core_refuses_mismatched_bias_buffers(device, registry):
    """The core op checks its bias buffers itself (dtype, size, presence) before it encodes."""
    from routemm import _core

    gate, up, down = _stacks()
    x, ids, weights = _routing()
    gate_up = np.concatenate([gate, up], axis=1)
    enc = device.command_encoder()
    bufs = [device.from_numpy(np.ascontiguousarray(a)) for a in (x, ids.astype(np.uint32), weights, gate_up, down)]
    out = device.alloc(M * H * 4, routemm.DType.F32, [M, H])
    params = (M, TOP_K, E, H, I, False, routemm.DType.F32, None, "direct")
    ws = device.alloc(
        _core._moe_experts_workspace_bytes(*params), routemm.DType.U8, [_core._moe_experts_workspace_bytes(*params)]
    )
    short = device.from_numpy(np.zeros((E, I), np.float32))  # [E, I], the op needs [E, 2I]
    with pytest.raises(routemm.InvalidArgumentError, match="moe_experts gate_up_bias requires"):
        _core._moe_experts(enc, registry, *bufs[:4], None, bufs[4], out, ws, *params, gate_up_bias=short)
    f16 = device.from_numpy(np.zeros((E, H), np.float16))
    with pytest.raises(routemm.InvalidArgumentError, match="moe_experts down_bias must be f32"):
        _core._moe_experts(enc, registry, *bufs[:4], None, bufs[4], out, ws, *params, down_bias=f16)
    with pytest.raises(routemm.InvalidArgumentError, match="moe_experts swiglu_limit must be > 0"):
        _core._moe_experts(
            enc, registry, *bufs[:4], None, bufs[4], out, ws, *params, activation="swiglu_oai", swiglu_limit=-1.0
        )
    with pytest.raises(routemm.InvalidArgumentError, match="moe_experts activation must be"):
        _core._moe_experts(enc, registry, *bufs[:4], None, bufs[4], out, ws, *params, activation="relu")
    # Nothing was encoded: the encoder commits empty and the output is untouched.
    enc.commit_and_wait()


# ---- torch path ----------------------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


def _torch_case(tdev, split=False, scale=2.0, ggml_type=None, top_k=TOP_K):
    """(x, ids, w, gate_up, down, up, biases as the torch op takes them, numpy stacks for the
    reference, numpy biases) on `tdev`."""
    torch = _torch()
    gate, up, down = _stacks(scale=scale)
    gb, ub, db = _biases()
    x, ids, w = _routing(top_k=top_k)
    if ggml_type is not None:
        codec = CODECS[ggml_type]
        q = [codec.quantize(a) for a in (gate, up, down)]
        gate, up, down = (codec.dequantize(b, a.shape) for b, a in zip(q, (gate, up, down), strict=True))
        stacks = [torch.from_numpy(b) for b in q]
        gate_up_t, up_t, down_t = (stacks[0], stacks[1], stacks[2])
        split = True
    elif split:
        gate_up_t, up_t, down_t = (torch.from_numpy(a) for a in (gate, up, down))
    else:
        gate_up_t, up_t, down_t = torch.from_numpy(np.concatenate([gate, up], axis=1)), None, torch.from_numpy(down)
    if split:
        bias_t = {"gate_up_bias": torch.from_numpy(gb), "up_bias": torch.from_numpy(ub)}
    else:
        bias_t = {"gate_up_bias": torch.from_numpy(np.concatenate([gb, ub], axis=1))}
    bias_t["down_bias"] = torch.from_numpy(db)
    move = lambda t: None if t is None else t.to(tdev)  # noqa: E731
    return (
        *(move(torch.from_numpy(a)) for a in (x, ids, w)), move(gate_up_t), move(down_t), move(up_t),
        {k: move(v) for k, v in bias_t.items()}, (gate, up, down), (gb, ub, db), (x, ids, w),
    )  # fmt: skip


@pytest.mark.parametrize("ggml_type", [None, "q4_0", "q8_0"])
@pytest.mark.parametrize("split", [False, True])
def test_torch_op_is_the_front_doors_bits_with_every_option(tdev, split, ggml_type):
    """Exact routes: torch.ops.routemm.moe_experts with the options gives routemm.moe_experts' bits
    (the same core op), and both agree with the float64 reference."""
    if ggml_type is not None and not split:
        pytest.skip("block stacks come as a gate and an up stack here")
    torch = _torch()
    import routemm.torch  # noqa: F401

    x, ids, w, gate_up, down, up, biases, stacks, bias_np, arrays = _torch_case(tdev, split, ggml_type=ggml_type)
    kw = dict(activation="swiglu_oai", swiglu_alpha=1.5, swiglu_limit=5.0, weights_before_ffn=True)
    got = torch.ops.routemm.moe_experts(x, ids, w, gate_up, down, up, ggml_type, True, **kw, **biases)
    np_kw = dict(kw)
    if split:
        np_kw.update(gate_bias=bias_np[0], up_bias=bias_np[1])
    else:
        np_kw.update(gate_up_bias=np.concatenate(bias_np[:2], axis=1))
    np_stacks = (gate_up.cpu().numpy(), up.cpu().numpy()) if split else gate_up.cpu().numpy()
    want_bits = routemm.moe_experts(
        *arrays, np_stacks, down.cpu().numpy(), ggml_type=ggml_type, down_bias=bias_np[2], device="cpu", **np_kw
    )
    if tdev == "cpu":
        np.testing.assert_array_equal(got.numpy(), want_bits)
    act = lambda g, u: _swiglu_oai(g, u, 1.5, 5.0)  # noqa: E731
    want = reference(
        *arrays, *stacks, act=act, gate_bias=bias_np[0], up_bias=bias_np[1], down_bias=bias_np[2], before=True
    )
    tol = 5e-2 if ggml_type else ATOL
    _close(got.cpu().numpy(), want, atol=tol, rtol=tol)


def test_torch_op_both_kernel_sets_agree_with_options(tdev):
    """The C++ kernels and the Python kernel (rt._moe_experts) give the same bits and refuse with
    the same words."""
    torch = _torch()
    import routemm.torch as rt

    x, ids, w, gate_up, down, up, biases, *_ = _torch_case(tdev)
    kw = dict(activation="swiglu_oai", weights_before_ffn=True, **biases)
    a = torch.ops.routemm.moe_experts(x, ids, w, gate_up, down, **kw)
    b = rt._moe_experts(x, ids, w, gate_up, down, **kw)
    assert torch.equal(a, b)
    e2i = biases["gate_up_bias"]
    cases = [
        ({"activation": "gelu"}, "activation must be 'silu' or 'swiglu_oai', got 'gelu'"),
        ({"swiglu_alpha": float("inf")}, "swiglu_alpha must be finite, got inf"),
        ({"swiglu_alpha": 1e300}, "swiglu_alpha must be finite"),
        ({"swiglu_limit": 0.0}, r"swiglu_limit must be > 0, got 0.000000"),
        ({"swiglu_limit": float("nan")}, "swiglu_limit must be > 0, got nan"),
        ({"gate_up_bias": e2i[:, :I]}, r"gate_up_bias must be \(6, 64\), got shape \(6, 32\)"),
        ({"gate_up_bias": e2i.int()}, "gate_up_bias must be a float tensor, got torch.int32"),
        ({"up_bias": e2i[:, :I]}, r"up_bias goes with split stacks \(up\) and gate_up_bias"),
        ({"down_bias": e2i[:, : H - 1]}, r"down_bias must be \(6, 64\), got shape \(6, 63\)"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(ValueError, match=message) as from_op:
            torch.ops.routemm.moe_experts(x, ids, w, gate_up, down, **extra)
        with pytest.raises(routemm.InvalidArgumentError) as from_python:
            rt._moe_experts(x, ids, w, gate_up, down, **extra)
        assert str(from_op.value) == str(from_python.value)
    # Split stacks: the gate's bias and the up bias come together.
    gate, upw = gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()
    with pytest.raises(ValueError, match="take gate_up_bias .the gate's. and up_bias together"):
        torch.ops.routemm.moe_experts(x, ids, w, gate, down, upw, gate_up_bias=e2i[:, :I].contiguous())


def test_torch_op_model_dtype_biases_and_compile(tdev):
    torch = _torch()
    import routemm.torch  # noqa: F401

    x, ids, w, gate_up, down, up, biases, *_ = _torch_case(tdev)
    xb, wb = x.bfloat16(), w.bfloat16()
    bb = {k: v.bfloat16() for k, v in biases.items()}
    kw = dict(activation="swiglu_oai", weights_before_ffn=True)
    eager = torch.ops.routemm.moe_experts(xb, ids, wb, gate_up, down, **kw, **bb)
    assert eager.dtype == torch.bfloat16
    # Biases in the model dtype are used as float32: the same as handing them over as float32.
    as_f32 = torch.ops.routemm.moe_experts(xb, ids, wb, gate_up, down, **kw, **{k: v.float() for k, v in bb.items()})
    assert torch.equal(eager, as_f32)

    def block(x_, w_, gub, db):
        return torch.ops.routemm.moe_experts(x_, ids, w_, gate_up, down, gate_up_bias=gub, down_bias=db, **kw)

    compiled = torch.compile(block, fullgraph=True, backend="eager")
    assert torch.equal(compiled(xb, wb, bb["gate_up_bias"], bb["down_bias"]), eager)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.routemm.moe_experts(
            mode.from_tensor(xb), mode.from_tensor(ids), mode.from_tensor(wb), mode.from_tensor(gate_up),
            mode.from_tensor(down), gate_up_bias=mode.from_tensor(bb["gate_up_bias"]), **kw,
        )  # fmt: skip
        assert fake.shape == eager.shape and fake.dtype == torch.bfloat16
        with pytest.raises(routemm.InvalidArgumentError, match="activation must be"):
            torch.ops.routemm.moe_experts(
                mode.from_tensor(xb), mode.from_tensor(ids), mode.from_tensor(wb), mode.from_tensor(gate_up),
                mode.from_tensor(down), activation="relu",
            )  # fmt: skip


def _torch_reference(x, ids, w, gate, up, down, gb, ub, db, activation, before, alpha=ALPHA, limit=LIMIT):
    """The block in float64 torch operations (the gradients' reference)."""
    torch = _torch()
    out = torch.zeros((x.shape[0], down.shape[1]), dtype=torch.float64)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(down.shape[1], dtype=torch.float64)
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if not 0 <= e < gate.shape[0]:
                continue
            xin = w[t, s] * x[t] if before else x[t]
            g, u = gate[e] @ xin, up[e] @ xin
            if gb is not None:
                g, u = g + gb[e], u + ub[e]
            if activation == "swiglu_oai":
                g = torch.clamp(g, max=limit)
                u = torch.clamp(u, min=-limit, max=limit)
                a = g * torch.sigmoid(alpha * g) * (u + 1)
            else:
                a = torch.nn.functional.silu(g) * u
            y = down[e] @ a
            if db is not None:
                y = y + db[e]
            acc = acc + (y if before else w[t, s] * y)
        rows.append(acc)
    return out + torch.stack(rows)


@pytest.mark.parametrize(
    ("activation", "with_bias", "before"),
    [("swiglu_oai", False, False), ("silu", True, False), ("silu", False, True), ("swiglu_oai", True, True)],
)
@pytest.mark.parametrize("split", [False, True])
def test_torch_gradients_match_float64_autograd(split, activation, with_bias, before):
    """Every input's gradient (hidden, weights, stacks, biases) against torch autograd of a float64
    reference, through both clamps of swiglu_oai (scale 3: some products past the limit)."""
    torch = _torch()
    import routemm.torch  # noqa: F401

    x, ids, w, gate_up, down, up, biases, *_ = _torch_case("cpu", split, scale=3.0)
    if not with_bias:
        biases = {}
    names = ["x", "w", "gate_up", "down"] + (["up"] if split else []) + list(biases)
    tensors = [x, w, gate_up, down] + ([up] if split else []) + list(biases.values())
    leaves = {n: t.clone().requires_grad_() for n, t in zip(names, tensors, strict=True)}
    kw = {k: leaves[k] for k in biases}
    out = torch.ops.routemm.moe_experts(
        leaves["x"], ids, leaves["w"], leaves["gate_up"], leaves["down"], leaves.get("up"),
        activation=activation, weights_before_ffn=before, **kw,
    )  # fmt: skip
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad_out)
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    gu = ref["gate_up"]
    gate, upw = (gu, ref["up"]) if split else (gu[:, :I], gu[:, I:])
    if with_bias:
        gub = ref["gate_up_bias"]
        gb, ub = (gub, ref["up_bias"]) if split else (gub[:, :I], gub[:, I:])
        db = ref["down_bias"]
    else:
        gb = ub = db = None
    want = _torch_reference(ref["x"], ids, ref["w"], gate, upw, ref["down"], gb, ub, db, activation, before)
    want.backward(grad_out.double())
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    for n in names:
        got, exp = leaves[n].grad, ref[n].grad
        assert got is not None and got.dtype == torch.float32, n
        err = float((got.double() - exp).abs().max() / exp.abs().max())
        assert err <= 1e-5, (n, err)
    if activation == "swiglu_oai":  # the clamps bind on these inputs: some gate/up products are past 7
        assert any(float(leaves[n].grad.abs().max()) > 0 for n in names)


def test_torch_block_stacks_give_the_biases_their_gradients():
    """Block stacks are frozen, the biases train: with swiglu_oai and every bias, the gradients of
    hidden, the routing weights and the three biases against float64 autograd on the dequantised
    stacks."""
    torch = _torch()
    import routemm.torch  # noqa: F401

    x, ids, w, gate, down, up, biases, arrays, *_ = _torch_case("cpu", ggml_type="q4_0", scale=3.0)
    names = ["x", "w", *biases]
    leaves = {n: t.clone().requires_grad_() for n, t in zip(names, [x, w, *biases.values()], strict=True)}
    kw = {k: leaves[k] for k in biases}
    out = torch.ops.routemm.moe_experts(
        leaves["x"], ids, leaves["w"], gate, down, up, "q4_0", activation="swiglu_oai", **kw
    )
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    out.backward(grad_out)
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    gate64, up64, down64 = (torch.from_numpy(a).double() for a in arrays)
    want = _torch_reference(
        ref["x"], ids, ref["w"], gate64, up64, down64, ref["gate_up_bias"], ref["up_bias"], ref["down_bias"],
        "swiglu_oai", False,
    )  # fmt: skip
    want.backward(grad_out.double())
    for n in names:
        got, exp = leaves[n].grad, ref[n].grad
        assert got is not None and got.dtype == torch.float32, n
        err = float((got.double() - exp).abs().max() / exp.abs().max())
        assert err <= 1e-5, (n, err)


def test_routemm_moe_experts_on_tensors_with_a_shared_expert(tdev):
    """routemm.moe_experts on torch tensors takes every option, the shared expert included, and
    gives the NumPy path's result."""
    torch = _torch()
    x, ids, w, gate_up, down, up, biases, stacks, bias_np, arrays = _torch_case(tdev)
    rng = np.random.default_rng(8)
    sg, su = (rng.standard_normal((I, H)).astype(np.float32) / H**0.5 for _ in range(2))
    sd = rng.standard_normal((H, I)).astype(np.float32) / I**0.5
    sv = rng.standard_normal(H).astype(np.float32) / H**0.5
    kw = dict(activation="swiglu_oai", weights_before_ffn=True, down_bias=biases["down_bias"])
    shared = dict(
        shared_gate_up=torch.from_numpy(np.concatenate([sg, su])).to(tdev), shared_down=torch.from_numpy(sd).to(tdev),
        shared_gate=torch.from_numpy(sv).to(tdev),
    )  # fmt: skip
    got = routemm.moe_experts(x, ids, w, gate_up, down, gate_up_bias=biases["gate_up_bias"], **kw, **shared)
    assert isinstance(got, torch.Tensor) and got.device == x.device
    want = reference(
        *arrays, *stacks, act=_swiglu_oai, gate_bias=bias_np[0], up_bias=bias_np[1], down_bias=bias_np[2],
        before=True, shared=(sg, su, sd, sv),
    )  # fmt: skip
    _close(got.cpu().numpy(), want)


# ---- MoeLayer ------------------------------------------------------------------------------------


def _layer_case(device, ggml_type=None, shared=True, gated=True):
    """A MoeLayer with every FFN option (and its numpy weights)."""
    rng = np.random.default_rng(11)
    router = (rng.standard_normal((E, H)) / H**0.5).astype(np.float32)
    gate, up, down = _stacks(scale=2.0)
    gb, ub, db = _biases()
    i_s = 64
    sg, su = (rng.standard_normal((i_s, H)).astype(np.float32) / H**0.5 for _ in range(2))
    sd = rng.standard_normal((H, i_s)).astype(np.float32) / i_s**0.5
    sv = rng.standard_normal(H).astype(np.float32) / H**0.5
    if ggml_type is not None:
        codec = CODECS[ggml_type]
        gate, up, down, sg, su, sd = (codec.quantize(a) for a in (gate, up, down, sg, su, sd))
    buf = device.from_numpy
    kw = dict(
        activation="swiglu_oai", gate_bias=buf(gb), up_bias=buf(ub), down_bias=buf(db), weights_before_ffn=True,
    )  # fmt: skip
    if shared:
        kw.update(shared_gate_up=(buf(sg), buf(su)), shared_down=buf(sd))
        if gated:
            kw["shared_gate"] = buf(sv)
    layer = routemm.MoeLayer(
        buf(router), buf(gate), buf(up), buf(down), top_k=TOP_K, renormalize=False, ggml_type=ggml_type,
        device=device, **kw,
    )  # fmt: skip
    return layer, (router, gb, ub, db, sv)


@pytest.mark.parametrize("ggml_type", [None, "q4_0", "q8_0"])
@pytest.mark.parametrize(("shared", "gated"), [(False, False), (True, False), (True, True)])
def test_moe_layer_with_every_option(device, ggml_type, shared, gated):
    layer, (router, gb, ub, db, sv) = _layer_case(device, ggml_type, shared, gated)
    x = np.random.default_rng(12).standard_normal((M, H)).astype(np.float32)
    got = layer(x)
    want, ids, _ = layer.reference(x)
    tol = 5e-2 if ggml_type else ATOL
    _close(got, want, atol=tol, rtol=tol)
    # The reference written here from the layer's float weights and its ids agrees.
    w = layer.float_weights()
    z = x.astype(np.float64) @ router.T.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    weights = np.take_along_axis(p, ids, 1)
    shared_w = None
    if shared:
        shared_w = (w["shared_gate"], w["shared_up"], w["shared_down"], sv if gated else None)
    mine = reference(
        x, ids, weights, w["gate"], w["up"], w["down"], act=_swiglu_oai, gate_bias=gb, up_bias=ub, down_bias=db,
        before=True, shared=shared_w,
    )  # fmt: skip
    _close(got, mine, atol=tol, rtol=tol)


def test_moe_layer_refuses_bad_ffn_options(device):
    layer, _ = _layer_case(device)
    buf = device.from_numpy
    rng = np.random.default_rng(13)
    router, gate, up, down = (layer.router, layer.gate, layer.up, layer.down)
    base = dict(top_k=TOP_K, renormalize=False, device=device)
    cases = [
        ({"activation": "gelu"}, "activation must be one of"),
        ({"swiglu_limit": -1.0}, "swiglu_limit must be > 0"),
        ({"gate_bias": buf(np.zeros((E, I), np.float32))}, "gate_bias and up_bias come together"),
        ({"down_bias": buf(np.zeros((E, I), np.float32))}, r"down_bias must be f32 \[6, 64\]"),
        ({"down_bias": buf(np.zeros((E, H), np.float16))}, r"down_bias must be f32"),
        ({"shared_down": buf(np.zeros((H, I), np.float32))}, "shared_gate_up and shared_down come together"),
        ({"shared_gate": buf(np.zeros(H, np.float32))}, "shared_gate needs shared_gate_up"),
        (
            {"shared_gate_up": buf(np.zeros((2 * I, H + 1), np.float32)), "shared_down": buf(np.zeros((H, I), np.float32))},
            "gate_up must be",
        ),
        (
            {"shared_gate_up": buf(rng.standard_normal((2 * I, H)).astype(np.float16)),
             "shared_down": buf(np.zeros((H, I), np.float16))},
            "weights must share one of",
        ),
        ({"shared_gate_up": np.zeros((2 * I, H), np.float32), "shared_down": buf(np.zeros((H, I), np.float32))}, "Buffer"),
    ]  # fmt: skip
    for extra, match in cases:
        with pytest.raises((routemm.InvalidArgumentError, TypeError), match=match):
            routemm.MoeLayer(router, gate, up, down, **base, **extra)
