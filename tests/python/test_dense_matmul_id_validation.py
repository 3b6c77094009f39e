"""Every rejection of spec §7.3 and the call validation: nothing is encoded, the encoder's capture
or receipt stays empty, dispatch_count does not move."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdMultiplicity as Mult
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from support import Case, distinct_ids, make_params, random_weights, validate

U32 = 2**32 - 1
U64 = 2**64 - 1
E = 8


# ---- capability ----------------------------------------------------------------------------------


def _cap(dtype=DType.BF16, **kw):
    base = dict(m=9, n=7, k=35, top_k=6, n_experts=8, stride=490)
    base.update(kw)
    return routemm.dense_matmul_id_capability(
        dtype,
        make_params(
            base["m"],
            base["n"],
            base["k"],
            base["top_k"],
            base["n_experts"],
            base["stride"],
            base.get("layout", Layout.SHARED_PER_TOKEN),
            base.get("mult", Mult.DISTINCT_PER_TOKEN),
            base.get("route", Route.DIRECT),
        ),
    )


@pytest.mark.parametrize("field", ["m", "n", "k", "top_k", "n_experts"])
def test_zero_dimension_rejected(field):
    before = routemm.dispatch_count()
    with pytest.raises(
        routemm.InvalidArgumentError, match=r"^dense_matmul_id M, N, K, top_k, and n_experts must be nonzero$"
    ):
        _cap(**{field: 0})
    assert routemm.dispatch_count() == before


@pytest.mark.parametrize(
    "spec,message",
    [
        (dict(top_k=9), "distinct top_k 9 exceeds n_experts 8"),
        (dict(dtype=DType.U32), "weights must be F32, F16, or BF16, got u32"),
        (dict(dtype=DType.U8), "weights must be F32, F16, or BF16, got u8"),
        (dict(dtype=DType.U16), "weights must be F32, F16, or BF16, got u16"),
        (dict(dtype=DType.I32), "weights must be F32, F16, or BF16, got i32"),
        (dict(stride=489), "expert stride 489 is smaller than one 490-byte matrix"),
        (dict(stride=491), "expert stride 491 is not aligned to bf16"),
        (dict(dtype=DType.F32, stride=980 + 2), "expert stride 982 is not aligned to f32"),
        # u64::MAX itself is odd (never aligned), so the largest aligned stride is used.
        (dict(n_experts=U32, stride=U64 - 1, top_k=1), "overflow"),
        (dict(dtype=DType.F32, n_experts=2, stride=U64 - 3, top_k=1), "dense_matmul_id weight extent overflow"),
        (dict(n=U32, k=U32, stride=U64), "dense_matmul_id expert matrix byte extent overflow"),
        (
            dict(m=U32, k=2**31, n=1, top_k=1, stride=2**32, layout=Layout.SLOTTED),
            "dense_matmul_id input byte extent overflow",
        ),
        (dict(m=2**31, top_k=1, n=2**31, stride=2**31 * 35 * 2), "dense_matmul_id output byte extent overflow"),
        (dict(m=2**31, top_k=2), "flattened routed rows exceed the u32 kernel ABI"),
        (
            dict(mult=Mult.MAY_REPEAT, route=Route.GROUPED_PREFILL),
            "grouped prefill requires distinct expert IDs per token",
        ),
        (dict(n_experts=1025, route=Route.GROUPED_PREFILL), "grouped prefill supports at most 1024 experts"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_capability_rejections(spec, message):
    spec = dict(spec)
    dtype = spec.pop("dtype", DType.BF16)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError) as info:
        _cap(dtype, **spec)
    assert str(info.value).startswith("dense_matmul_id ")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, routemm.Error)
    assert routemm.dispatch_count() == before


def test_capability_accepts_boundaries():
    assert _cap(top_k=8).required_ids_bytes == 9 * 8 * 4  # top_k == n_experts is fine
    assert _cap(top_k=9, mult=Mult.MAY_REPEAT).required_ids_bytes == 9 * 9 * 4
    assert _cap(stride=492).required_weight_bytes == 7 * 492 + 490
    cap = _cap(n_experts=1024, route=Route.GROUPED_PREFILL)
    assert cap.scratch.expert_counts_bytes == 4096 and cap.scratch.routed_rows_bytes == 1024 * 9 * 4
    cap = _cap(m=U32, top_k=1, n_experts=1, mult=Mult.MAY_REPEAT)  # exactly u32::MAX rows
    assert cap.required_ids_bytes == U32 * 4
    for c in (cap, _cap()):
        validate(c)


def test_capability_extents_trace_example():
    """m=9, top_k=6, n=7, k=35, 8 BF16 experts with a 14-byte padded stride."""
    cap = _cap(stride=504, route=Route.GROUPED_PREFILL)
    assert (cap.weight_dtype, cap.route) == (DType.BF16, Route.GROUPED_PREFILL)
    assert cap.required_weight_bytes == 7 * 504 + 490
    assert cap.required_input_bytes == 9 * 35 * 4
    assert cap.required_ids_bytes == 54 * 4
    assert cap.required_output_bytes == 54 * 7 * 4
    assert (cap.scratch.expert_counts_bytes, cap.scratch.routed_rows_bytes) == (32, 8 * 9 * 4)
    slotted = _cap(stride=504, layout=Layout.SLOTTED)
    assert slotted.required_input_bytes == 54 * 35 * 4 and slotted.scratch is None


def test_scratch_capacities_must_be_nonzero(device):
    before = routemm.dispatch_count()
    for experts, tokens in ((0, 9), (8, 0), (0, 0)):
        with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id scratch capacities must be nonzero"):
            routemm.DenseMatmulIdScratch(device, experts, tokens)
    assert routemm.dispatch_count() == before
    s = routemm.DenseMatmulIdScratch(device, 8, 9)
    assert (s.max_experts, s.max_tokens) == (8, 9)
    assert s.expert_counts.dtype == DType.U32 and s.expert_counts.nbytes == 32
    assert s.routed_rows.dtype == DType.U32 and s.routed_rows.nbytes == 8 * 9 * 4


# ---- call validation -----------------------------------------------------------------------------


class Call:
    """A valid grouped/direct F32 call (m=9, top_k=6, n=7, k=35) whose buffers a test then breaks."""

    def __init__(self, device, registry, rng, dtype=DType.F32):
        self.device, self.registry = device, registry
        w = random_weights(rng, dtype, (E, 7, 35))
        x = rng.uniform(-1, 1, (9, 35)).astype(np.float32)
        self.case = Case(device, registry, dtype, w, x, distinct_ids(rng, 9, 6, E), slotted=False, pad=12)
        self.weights, self.input = self.case.weights.view, self.case.input.view
        self.ids, self.output = self.case.id_buf.view, self.case.output.view
        self.scratch = self.case.scratch
        self.route = Route.GROUPED_PREFILL
        self.params_override = None

    @property
    def params(self):
        return self.params_override or self.case.params(self.route)

    def cap(self):
        return routemm.dense_matmul_id_capability(self.weights.dtype, self.params)

    def invoke(self, encoder):
        return routemm.dense_matmul_id(
            encoder, self.registry, self.weights, self.input, self.ids, self.output, self.scratch, self.params
        )


@contextlib.contextmanager
def untouched_encoder(device, mode):
    """Yields an encoder with an open capture or receipt; afterwards it must hold nothing."""
    encoder = device.command_encoder()
    if mode == "capture":
        encoder.start_capture()
    else:
        encoder.start_encoded_dispatch_receipt(4)
    before = routemm.dispatch_count()
    barriers = routemm.encoder_counters()["barriers"]
    yield encoder
    assert routemm.dispatch_count() == before, "validation failure encoded a dispatch"
    assert routemm.encoder_counters()["barriers"] == barriers
    assert encoder.pending_dispatches == 0
    if mode == "capture":
        assert encoder.take_capture() == [], "capture not empty after a rejected call"
    else:
        assert encoder.take_encoded_dispatch_receipt() == [], "receipt not empty after a rejected call"


def _short(buf, by):
    return buf.view(0, buf.nbytes - by, buf.dtype)


def _retag(buf, dtype):
    return buf.view(0, buf.nbytes // dtype.size * dtype.size, dtype)


BREAKS = {
    # name: (mutator(call, rng), expected message)
    "weights dtype": (
        lambda c: setattr(c, "weights", _retag(c.weights, DType.U32)),
        "dense_matmul_id weights must be F32, F16, or BF16, got u32",
    ),
    "input dtype": (
        lambda c: setattr(c, "input", _retag(c.input, DType.BF16)),
        "dense_matmul_id input must be f32, got bf16",
    ),
    "ids dtype": (
        lambda c: setattr(c, "ids", _retag(c.ids, DType.I32)),
        "dense_matmul_id expert IDs must be u32, got i32",
    ),
    "output dtype": (
        lambda c: setattr(c, "output", _retag(c.output, DType.U32)),
        "dense_matmul_id output must be f32, got u32",
    ),
    "weights extent": (
        lambda c: setattr(c, "weights", _short(c.weights, 4)),
        "dense_matmul_id weights requires {w} logical bytes, got {w_1}",
    ),
    "input extent": (
        lambda c: setattr(c, "input", _short(c.input, 4)),
        "dense_matmul_id input requires 1260 logical bytes, got 1256",
    ),
    "ids extent": (
        lambda c: setattr(c, "ids", _short(c.ids, 4)),
        "dense_matmul_id expert IDs requires 216 logical bytes, got 212",
    ),
    "output extent": (
        lambda c: setattr(c, "output", _short(c.output, 4)),
        "dense_matmul_id output requires 1512 logical bytes, got 1508",
    ),
    "missing scratch": (
        lambda c: setattr(c, "scratch", None),
        "dense_matmul_id grouped prefill requires caller-owned scratch",
    ),
    "scratch 7/8": (
        lambda c: setattr(c, "scratch", routemm.DenseMatmulIdScratch(c.device, 7, 8)),
        "dense_matmul_id scratch capacity experts/tokens=7/8 is smaller than 8/9",
    ),
    "scratch 8/8": (
        lambda c: setattr(c, "scratch", routemm.DenseMatmulIdScratch(c.device, 8, 8)),
        "dense_matmul_id scratch capacity experts/tokens=8/8 is smaller than 8/9",
    ),
    "scratch 7/9": (
        lambda c: setattr(c, "scratch", routemm.DenseMatmulIdScratch(c.device, 7, 9)),
        "dense_matmul_id scratch capacity experts/tokens=7/9 is smaller than 8/9",
    ),
    "grouped may_repeat": (
        lambda c: setattr(
            c,
            "params_override",
            make_params(9, 7, 35, 6, E, c.case.stride, mult=Mult.MAY_REPEAT, route=Route.GROUPED_PREFILL),
        ),
        "dense_matmul_id grouped prefill requires distinct expert IDs per token",
    ),
    "zero m": (
        lambda c: setattr(c, "params_override", make_params(0, 7, 35, 6, E, c.case.stride)),
        "dense_matmul_id M, N, K, top_k, and n_experts must be nonzero",
    ),
}


@pytest.mark.parametrize("mode", ["capture", "receipt"])
@pytest.mark.parametrize("name", list(BREAKS))
def test_call_validation_leaves_encoder_untouched(device, registry, rng, mode, name):
    call = Call(device, registry, rng)
    mutate, message = BREAKS[name]
    required_w = call.cap().required_weight_bytes
    message = message.format(w=required_w, w_1=required_w - 4)
    mutate(call)
    with untouched_encoder(device, mode) as enc:
        with pytest.raises(routemm.InvalidArgumentError) as info:
            call.invoke(enc)
    assert message in str(info.value)


@pytest.mark.parametrize("route", [Route.DIRECT, Route.GROUPED_PREFILL])
@pytest.mark.parametrize("bad", ["scratch", 0, "buffer"])
def test_scratch_of_the_wrong_type_is_a_type_error(device, registry, rng, route, bad):
    """A scratch that is neither None nor a DenseMatmulIdScratch is a TypeError naming the type, at
    the front door and at the native entry under it, before anything is encoded."""
    call = Call(device, registry, rng)
    call.route = route
    call.scratch = call.output if bad == "buffer" else bad
    name = {"scratch": "str", 0: "int", "buffer": "Buffer"}[bad]
    with untouched_encoder(device, "capture") as enc:
        with pytest.raises(TypeError, match=f"scratch must be a DenseMatmulIdScratch or None, not {name}"):
            call.invoke(enc)
        with pytest.raises(TypeError, match=f"scratch must be a DenseMatmulIdScratch or None, not {name}"):
            routemm._core._dense_matmul_id(
                enc,
                registry,
                call.weights,
                call.input,
                call.ids,
                call.output,
                call.scratch,
                call.params._native_params,
            )


def test_extent_one_byte_short_is_not_even_a_buffer(device, registry, rng):
    """required - 1 bytes cannot be expressed as an F32/BF16 view (whole elements only), so the
    call-level extent tests above use required - one element."""
    call = Call(device, registry, rng, dtype=DType.BF16)
    with pytest.raises(routemm.InvalidArgumentError):
        call.weights.view(0, call.weights.nbytes - 1, DType.BF16)
    call.weights = call.weights.view(0, call.weights.nbytes - 2, DType.BF16)
    need = call.cap().required_weight_bytes
    with untouched_encoder(device, "capture") as enc:
        with pytest.raises(
            routemm.InvalidArgumentError, match=f"dense_matmul_id weights requires {need} logical bytes, got {need - 2}"
        ):
            call.invoke(enc)


@pytest.mark.parametrize("mode", ["capture", "receipt"])
@pytest.mark.parametrize(
    "which,label,dtype",
    [
        ("input", "input", DType.F32),
        ("ids", "expert IDs", DType.U32),
        ("output", "output", DType.F32),
        ("weights", "weights", DType.F32),
        ("weights_bf16", "weights", DType.BF16),
    ],
)
def test_misaligned_view_rejected(device, registry, rng, mode, which, label, dtype):
    """A view at byte offset 2 (1 for bf16) of an otherwise valid buffer."""
    call = Call(device, registry, rng, dtype=DType.BF16 if which == "weights_bf16" else DType.F32)
    attr = "weights" if which.startswith("weights") else which
    good = getattr(call, attr)
    offset = 1 if dtype is DType.BF16 else 2
    parent = device.alloc(good.nbytes + 16, DType.U8)
    parent.copy_from_numpy(np.zeros(good.nbytes + 16, np.uint8))
    setattr(call, attr, parent.view(offset, good.nbytes, dtype))
    with untouched_encoder(device, mode) as enc:
        with pytest.raises(
            routemm.InvalidArgumentError,
            match=f"dense_matmul_id {label} byte offset {offset} is not aligned to {dtype.type_name}",
        ):
            call.invoke(enc)


def _shared_f32(device, nbytes):
    parent = device.alloc(nbytes, DType.F32)
    parent.copy_from_numpy(np.zeros(nbytes // 4, np.float32))
    return parent


@pytest.mark.parametrize("mode", ["capture", "receipt"])
@pytest.mark.parametrize("victim,label", [("weights", "weights"), ("input", "input"), ("ids", "expert IDs")])
@pytest.mark.parametrize("route", [Route.DIRECT, Route.GROUPED_PREFILL], ids=lambda r: r.value)
def test_output_overlap_rejected(device, registry, rng, mode, victim, label, route):
    """Output sharing bytes with weights / input / ids of the same allocation is rejected; the same
    views placed back to back (half-open ranges touching) are accepted."""
    call = Call(device, registry, rng)
    call.route = route
    cap = call.cap()
    victim_buf = getattr(call, victim)
    need = {"weights": cap.required_weight_bytes, "input": cap.required_input_bytes, "ids": cap.required_ids_bytes}[
        victim
    ]
    out_bytes = cap.required_output_bytes
    parent = _shared_f32(device, need + out_bytes + 64)
    # Victim at [0, need), output starting 4 bytes before the victim's end: one element shared.
    v = parent.view(0, need, victim_buf.dtype)
    v.copy_from_numpy(victim_buf.numpy().reshape(-1).view(np.uint8).view(victim_buf.numpy().dtype))
    setattr(call, victim, v)
    call.output = parent.view(need - 4, out_bytes, DType.F32)
    with untouched_encoder(device, mode) as enc:
        with pytest.raises(routemm.InvalidArgumentError, match=f"dense_matmul_id output must not overlap {label}"):
            call.invoke(enc)
    # Touching but not overlapping: fine, and computes the right thing.
    call.output = parent.view(need, out_bytes, DType.F32)
    enc = device.command_encoder()
    receipt = call.invoke(enc)
    enc.commit_and_wait()
    assert receipt.route is route
    ref, _ = call.case.reference()
    np.testing.assert_allclose(call.output.numpy().reshape(ref.shape), ref, atol=1e-4, rtol=1e-4)


def test_output_is_the_input_buffer(device, registry, rng):
    """Spec §8: output aliasing input (the same buffer) -> 'output must not overlap input'."""
    call = Call(device, registry, rng)
    call.route = Route.DIRECT
    call.params_override = make_params(9, 9, 9, 1, E, 9 * 9 * 4)
    w = device.alloc(E * 81 * 4, DType.F32)
    call.weights = w
    same = device.alloc(81 * 4, DType.F32)
    call.input, call.output = same, same
    call.ids = device.from_numpy(np.zeros((9, 1), np.uint32))
    with untouched_encoder(device, "capture") as enc:
        with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id output must not overlap input"):
            call.invoke(enc)


def test_receipt_without_room_rejects_before_encoding(device, registry, rng):
    """A receipt of capacity 1 cannot take the grouped route's two dispatches: nothing encoded."""
    call = Call(device, registry, rng)
    enc = device.command_encoder()
    enc.start_encoded_dispatch_receipt(1)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError):
        call.invoke(enc)
    assert routemm.dispatch_count() == before
    assert enc.pending_dispatches == 0
    assert enc.take_encoded_dispatch_receipt() == []
    # The direct route fits.
    call.route = Route.DIRECT
    enc.start_encoded_dispatch_receipt(1)
    call.invoke(enc)
    assert len(enc.take_encoded_dispatch_receipt()) == 1
    enc.commit_and_wait()


# ---- injected pipeline lookup failures ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["capture", "receipt"])
@pytest.mark.parametrize(
    "dtype,pipeline",
    [
        (DType.F32, "dense_matmul_id_grouped_f32_f32"),
        (DType.BF16, "dense_matmul_id_grouped_bf16_f32"),
        (DType.F32, "dense_matmul_id_map_distinct"),
    ],
)
def test_injected_grouped_lookup_failure(device, registry, rng, mode, dtype, pipeline):
    call = Call(device, registry, rng, dtype=dtype)
    registry.inject_next_pipeline_lookup_failure(pipeline)
    with untouched_encoder(device, mode) as enc:
        with pytest.raises(routemm.KernelNotFoundError) as info:
            call.invoke(enc)
    assert pipeline in str(info.value)
    assert isinstance(info.value, LookupError) and isinstance(info.value, routemm.Error)
    # One-shot: the same call now succeeds and computes the right result.
    result = call.case.run(Route.GROUPED_PREFILL)
    ref, _ = call.case.reference()
    np.testing.assert_allclose(result.out, ref, atol=1e-4, rtol=1e-4)


def test_injected_direct_lookup_failure(device, registry, rng):
    call = Call(device, registry, rng)
    call.route = Route.DIRECT
    registry.inject_next_pipeline_lookup_failure("dense_matmul_id_direct_f32_f32")
    with untouched_encoder(device, "capture") as enc:
        with pytest.raises(routemm.KernelNotFoundError, match="dense_matmul_id_direct_f32_f32"):
            call.invoke(enc)


@pytest.mark.parametrize("field", ["m", "n", "k", "top_k", "n_experts", "expert_stride_bytes"])
@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, "4"])
def test_params_must_be_integers_not_bools(field, value):
    """True is not a token count (the Q4 params refuse bools too)."""
    fields = dict(m=1, n=1, k=1, top_k=1, n_experts=1, expert_stride_bytes=4)
    fields[field] = value
    with pytest.raises(routemm.InvalidArgumentError, match=f"dense_matmul_id {field} must be a u"):
        routemm.dense_matmul_id_capability(DType.F32, routemm.DenseMatmulIdParams(**fields))


@pytest.mark.parametrize(
    "field,value",
    [("input_layout", "rows"), ("id_multiplicity", 1), ("route", "fast"), ("route", None)],
)
def test_params_enums_must_be_members(field, value):
    with pytest.raises(routemm.InvalidArgumentError, match=f"dense_matmul_id {field} must be one of"):
        routemm.DenseMatmulIdParams(1, 1, 1, 1, 1, 4, **{field: value})  # refused at construction


def test_params_must_be_the_params_record():
    with pytest.raises(routemm.InvalidArgumentError, match="params must be a DenseMatmulIdParams"):
        routemm.dense_matmul_id_capability(DType.F32, {"m": 1})
