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
