"""Fail closed at the front doors: a refused call leaves the encoder as it was, extents are checked
on shapes before anything is copied, and wrong-typed arguments are routemm errors naming them.

  * Every front door that encodes more than one dispatch (the grouped routes of dense_matmul_id and
    quantized_matmul_id_ggml, moe_experts, a captured graph's replay) is all or nothing: after a
    refused call the encoder holds the same pending dispatches, the process counters did not move
    and a commit writes nothing the call would have written (a poisoned output stays poisoned).
  * The NumPy front doors check extents on the shapes, so a zero-stride (virtual) array of 2^33
    rows is refused without being copied.
  * None, an array or a number where a buffer, encoder, registry, scratch or params go is an
    InvalidArgumentTypeError (a routemm.Error that is also a TypeError) naming the argument.

No torch here: .ci/run also runs this file against the ASan + UBSan build of the extension.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdRoute as Route
from routemm import DType, GgmlQuantizedMatmulIdRoute, GgmlType
from support import POISON_U32, poison_words

M, N, K, TOP_K, E = 4, 8, 64, 2, 4
IDS = np.array([[0, 1], [2, 3], [1, 0xFFFFFFFF], [3, 2]], np.uint32)  # one invalid id: the map zeroes its row
HUGE = 2**33  # tokens of a zero-stride array: 128 GiB once copied as int64 ids


@pytest.fixture
def cpu():
    return routemm.Device("cpu")


def poisoned(device, rows: int, cols: int) -> routemm.Buffer:
    buf = device.alloc(rows * cols * 4, DType.F32, [rows, cols])
    buf.copy_from_numpy(poison_words(rows * cols))
    return buf


def assert_poisoned(buf: routemm.Buffer, what: str) -> None:
    assert (buf.numpy().view(np.uint32) == POISON_U32).all(), f"{what} was written by a refused call"


def odd_address(device, data: np.ndarray, dtype: DType = DType.U8, shape=None) -> routemm.Buffer:
    """`data`'s bytes in a CPU buffer whose allocation starts at an odd address (byte offset 0)."""
    raw = np.zeros(data.nbytes + 1, np.uint8)
    raw[1:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    buf = routemm.from_dlpack(raw[1:])
    assert buf.address % 2 == 1 and buf.byte_offset == 0
    return buf.view(0, data.nbytes, dtype, list(data.shape if shape is None else shape))


# ---- the calls ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """One valid call of an expert-ID front door on a grouped route; breakers edit its fields."""

    device: routemm.Device
    quantized: bool
    route: object = None
    encoder: object = None
    registry: object = None
    weights: object = None
    input: object = None
    ids: object = None
    output: object = None
    scratch: object = None
    reuse_map: bool = False
    weight_array: np.ndarray | None = None

    def __post_init__(self):
        rng = np.random.default_rng(7)
        d = self.device
        self.registry = routemm.KernelRegistry(d)
        w = rng.uniform(-1, 1, (E, N, K)).astype(np.float32)
        self.weight_array = routemm.q4_0.quantize(w) if self.quantized else w
        self.weights = d.from_numpy(self.weight_array)
        self.input = d.from_numpy(rng.uniform(-1, 1, (M, K)).astype(np.float32))
        self.ids = d.from_numpy(IDS)
        self.output = poisoned(d, M * TOP_K, N)
        self.scratch = routemm.DenseMatmulIdScratch(d, E, M)
        if self.route is None:
            self.route = GgmlQuantizedMatmulIdRoute.GROUPED if self.quantized else Route.GROUPED_PREFILL

    @property
    def op(self) -> str:
        return "quantized_matmul_id_ggml" if self.quantized else "dense_matmul_id"

    def params(self):
        if self.quantized:
            return routemm.GgmlQuantizedMatmulIdParams(
                M, N, K, TOP_K, E, GgmlType.Q4_0, N * K // 32 * 18, Layout.SHARED_PER_TOKEN, self.route
            )
        return routemm.DenseMatmulIdParams(M, N, K, TOP_K, E, N * K * 4, route=self.route)

    def invoke(self):
        if self.quantized:
            return routemm.quantized_matmul_id_ggml(
                self.encoder, self.registry, self.input, self.weights, self.ids, self.output, self.scratch,
                self.params(), reuse_map=self.reuse_map,
            )  # fmt: skip
        return routemm.dense_matmul_id(
            self.encoder, self.registry, self.weights, self.input, self.ids, self.output, self.scratch,
            self.params(), reuse_map=self.reuse_map,
        )  # fmt: skip


def _odd_weights(call: Call):
    if call.device.backend != "cpu":
        pytest.skip("an allocation at an odd address comes from DLPack on the CPU")
    call.weights = odd_address(call.device, call.weight_array, DType.U8 if call.quantized else DType.F32)


def _reuse_without_map(call: Call):
    call.reuse_map = True


def _receipt_room_for_one(call: Call):
    call.encoder.start_encoded_dispatch_receipt(1)  # the grouped route needs two


def _missing_pipeline(call: Call):
    if call.quantized:
        call.route = GgmlQuantizedMatmulIdRoute.GROUPED_TENSOR_LOWP
        name = call.route.pipelines(GgmlType.Q4_0)[-1]
    else:
        call.route = Route.GROUPED_TENSOR_TF32
        name = routemm.DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES[0]
    if call.registry.has_kernel(name):
        pytest.skip(f"{call.device.backend} has the tensor-core pipelines")


# name: (breaker, expected exception, message fragment)
BREAKERS: dict[str, tuple[Callable[[Call], None], type, str | None]] = {
    "weights at an odd address": (_odd_weights, routemm.InvalidArgumentError, "weights start address"),
    "short weights": (
        lambda c: setattr(c, "weights", c.weights.view(0, c.weights.nbytes - 4, c.weights.dtype)),
        routemm.InvalidArgumentError,
        "weights requires",
    ),
    "output over the input": (
        lambda c: setattr(c, "output", c.input.view(0, M * TOP_K * N * 4, DType.F32, [M * TOP_K, N])),
        routemm.InvalidArgumentError,
        "must not overlap",
    ),
    "no scratch": (
        lambda c: setattr(c, "scratch", None),
        routemm.InvalidArgumentError,
        "requires caller-owned scratch",
    ),
    "small scratch": (
        lambda c: setattr(c, "scratch", routemm.DenseMatmulIdScratch(c.device, E, M - 1)),
        routemm.InvalidArgumentError,
        "scratch capacity",
    ),
    "reuse of a map never built": (_reuse_without_map, routemm.InvalidArgumentError, "the scratch holds no map"),
    "receipt without room": (_receipt_room_for_one, routemm.InvalidArgumentError, "open dispatch receipt has room"),
    "missing tensor pipeline": (_missing_pipeline, routemm.KernelNotFoundError, None),
    "scratch is an array": (
        lambda c: setattr(c, "scratch", np.zeros(4, np.uint32)),
        routemm.InvalidArgumentTypeError,
        "scratch must be a DenseMatmulIdScratch or None, not ndarray",
    ),
    "weights are an array": (
        lambda c: setattr(c, "weights", c.weight_array),
        routemm.InvalidArgumentTypeError,
        "weights must be a Buffer, not ndarray",
    ),
    "output is None": (
        lambda c: setattr(c, "output", None),
        routemm.InvalidArgumentTypeError,
        "output must be a Buffer",
    ),
    "ids are a list": (
        lambda c: setattr(c, "ids", IDS.tolist()),
        routemm.InvalidArgumentTypeError,
        "ids must be a Buffer",
    ),
    "registry is None": (
        lambda c: setattr(c, "registry", None),
        routemm.InvalidArgumentTypeError,
        "registry must be a KernelRegistry, not NoneType",
    ),
}


def witness(device):
    """An encoder holding one valid, uncommitted dispatch, and the output that dispatch writes."""
    encoder = device.command_encoder()
    registry = routemm.KernelRegistry(device)
    w = device.from_numpy(np.ones((1, 2, 32), np.float32))
    x = device.from_numpy(np.ones((1, 32), np.float32))
    out = poisoned(device, 1, 2)
    params = routemm.DenseMatmulIdParams(1, 2, 32, 1, 1, 2 * 32 * 4)
    routemm.dense_matmul_id(encoder, registry, w, x, device.from_numpy(np.zeros((1, 1), np.uint32)), out, None, params)
    return encoder, out


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "q4_0"])
@pytest.mark.parametrize("breaker", list(BREAKERS))
def test_refused_grouped_call_leaves_the_encoder_as_it_was(device, quantized, breaker):
    """The grouped routes encode a map and a grouped dispatch: a call refused for any reason adds
    neither (nor a barrier), and a later commit runs only what was there before."""
    call = Call(device, quantized)
    call.encoder, witness_out = witness(device)
    mutate, error, message = BREAKERS[breaker]
    output = call.output
    mutate(call)
    pending = call.encoder.pending_dispatches
    counters = routemm.encoder_counters()
    with pytest.raises(error, match=message) as info:
        call.invoke()
    assert isinstance(info.value, routemm.Error)
    if error is routemm.InvalidArgumentTypeError:
        assert isinstance(info.value, TypeError) and call.op in str(info.value)
    assert call.encoder.pending_dispatches == pending == 1
    after = routemm.encoder_counters()
    assert (after["dispatches"], after["barriers"]) == (counters["dispatches"], counters["barriers"])
    if call.encoder.has_open_receipt():
        assert call.encoder.take_encoded_dispatch_receipt() == []
    call.encoder.commit_and_wait()
    assert not (witness_out.numpy().view(np.uint32) == POISON_U32).any(), "the earlier dispatch did not run"
    assert_poisoned(output, "output")


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "q4_0"])
def test_odd_address_weights_are_refused_by_name_before_encoding(cpu, quantized):
    """The alignment a kernel needs is of the first byte it reads (allocation address plus byte
    offset), checked by the front door: the refusal names the op and the weights."""
    for route in (
        [GgmlQuantizedMatmulIdRoute.DIRECT, GgmlQuantizedMatmulIdRoute.GROUPED]
        if quantized
        else [Route.DIRECT, Route.GROUPED_PREFILL]
    ):
        call = Call(cpu, quantized, route)
        call.encoder = cpu.command_encoder()
        _odd_weights(call)
        before = routemm.dispatch_count()
        with pytest.raises(routemm.InvalidArgumentError, match=f"{call.op} weights start address 0x[0-9a-f]+ "):
            call.invoke()
        assert routemm.dispatch_count() == before and call.encoder.pending_dispatches == 0
        call.encoder.commit_and_wait()
        assert_poisoned(call.output, "output")


def test_odd_address_operands_of_the_moe_kernels_are_refused_by_name(cpu):
    registry = routemm.KernelRegistry(cpu)
    encoder = cpu.command_encoder()
    logits = odd_address(cpu, np.zeros((2, 4), np.float32), DType.F32)
    weights, ids = poisoned(cpu, 2, 2), cpu.alloc(16, DType.U32, [2, 2])
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate logits start address"):
        routemm.encode_moe_gate(encoder, registry, logits, weights, ids, top_k=2, renormalize=True)
    rows = odd_address(cpu, np.zeros((4, 8), np.float32), DType.F32)
    with pytest.raises(routemm.InvalidArgumentError, match="moe_combine rows start address"):
        routemm.encode_moe_combine(encoder, registry, rows, weights, ids, poisoned(cpu, 2, 8), n_experts=4)
    assert encoder.pending_dispatches == 0


def test_refused_moe_experts_encodes_nothing(cpu):
    """moe_experts encodes its matmuls, SiLU*up and the combine as one unit: a down stack its kernel
    cannot read refuses the whole block, and none of it stays encoded (the gate/up matmul and
    SiLU*up before it included)."""
    rng = np.random.default_rng(3)
    m, top_k, n_experts, hidden, inter = 4, 2, 4, 32, 32
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2], [3, 0]], np.int32)
    w = np.full((m, top_k), 0.5, np.float32)
    gate_up = routemm.q4_0.quantize(rng.standard_normal((n_experts, 2 * inter, hidden)).astype(np.float32))
    down = routemm.q4_0.quantize(rng.standard_normal((n_experts, hidden, inter)).astype(np.float32))
    for route in ("direct", "grouped"):
        before = routemm.encoder_counters()
        with pytest.raises(routemm.InvalidArgumentError, match="quantized_matmul_id_ggml weights start address"):
            routemm.moe_experts(
                x, ids, w, gate_up, odd_address(cpu, down), ggml_type=GgmlType.Q4_0, route=route, device=cpu
            )
        after = routemm.encoder_counters()
        assert (after["dispatches"], after["barriers"]) == (before["dispatches"], before["barriers"])
        routemm.moe_experts(x, ids, w, gate_up, down, ggml_type=GgmlType.Q4_0, route=route, device=cpu)


@pytest.mark.parametrize("replay", ["encode_sequential", "encode_with_barriers"])
def test_refused_graph_replay_encodes_nothing(device, replay):
    """A captured graph replays as one unit: a receipt without room for all of it refuses the
    replay at its second dispatch, and the first does not stay encoded."""
    registry = routemm.KernelRegistry(device)
    w = device.from_numpy(np.ones((1, 2, 32), np.float32))
    x = device.from_numpy(np.ones((1, 32), np.float32))
    ids = device.from_numpy(np.zeros((1, 1), np.uint32))
    outs = [poisoned(device, 1, 2) for _ in range(2)]
    params = routemm.DenseMatmulIdParams(1, 2, 32, 1, 1, 2 * 32 * 4)
    encoder = device.command_encoder()
    encoder.start_capture()
    for out in outs:
        routemm.dense_matmul_id(encoder, registry, w, x, ids, out, None, params)
    graph = encoder.take_graph()
    encoder.start_encoded_dispatch_receipt(1)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match="receipt capacity"):
        getattr(graph, replay)(encoder)
    assert routemm.dispatch_count() == before and encoder.pending_dispatches == 0
    assert encoder.take_encoded_dispatch_receipt() == []
    encoder.commit_and_wait()
    for out in outs:
        assert_poisoned(out, "a replayed dispatch's output")


@pytest.mark.parametrize("mode", ["plain", "capture", "receipt"])
def test_a_transaction_refused_partway_drops_what_it_encoded(device, mode):
    """The mechanism under the multi-dispatch front doors (CommandEncoder::Transaction, the
    with-block of encoder._transaction()): what a block encoded before it raised -- dispatches,
    barriers, capture nodes, receipt entries -- is gone; a block that ends normally is kept."""
    registry = routemm.KernelRegistry(device)
    w = device.from_numpy(np.ones((1, 2, 32), np.float32))
    x = device.from_numpy(np.ones((1, 32), np.float32))
    ids = device.from_numpy(np.zeros((1, 1), np.uint32))
    params = routemm.DenseMatmulIdParams(1, 2, 32, 1, 1, 2 * 32 * 4)
    dropped, kept = poisoned(device, 1, 2), poisoned(device, 1, 2)
    encoder = device.command_encoder()
    if mode == "capture":
        encoder.start_capture()
    elif mode == "receipt":
        encoder.start_encoded_dispatch_receipt(8)
    counters = routemm.encoder_counters()
    with pytest.raises(RuntimeError, match="refused partway"):
        with encoder._transaction():
            with encoder._transaction():  # an op's own transaction nests inside
                routemm.dense_matmul_id(encoder, registry, w, x, ids, dropped, None, params)
            encoder.memory_barrier()
            routemm.dense_matmul_id(encoder, registry, w, x, ids, dropped, None, params)
            with pytest.raises(routemm.Error, match="all-or-nothing"):
                encoder.commit()
            raise RuntimeError("refused partway")
    after = routemm.encoder_counters()
    assert (after["dispatches"], after["barriers"]) == (counters["dispatches"], counters["barriers"])
    assert encoder.pending_dispatches == 0
    with encoder._transaction():
        routemm.dense_matmul_id(encoder, registry, w, x, ids, kept, None, params)
    assert routemm.dispatch_count() == counters["dispatches"] + 1
    if mode == "capture":
        nodes = encoder.take_capture()  # the kept block's dispatch alone: no barrier, no dropped node
        assert [n.kind for n in nodes] == ["dispatch"]
        return
    if mode == "receipt":
        assert len(encoder.take_encoded_dispatch_receipt()) == 1
    assert encoder.pending_dispatches == 1
    encoder.commit_and_wait()
    assert_poisoned(dropped, "a dropped dispatch's output")
    assert kept.numpy().tolist() == [[32.0, 32.0]]


# ---- extents before copies ------------------------------------------------------------------------


def virtual(value, shape) -> np.ndarray:
    return np.broadcast_to(value, shape)


@pytest.mark.parametrize("ggml_type", [None, GgmlType.Q4_0])
@pytest.mark.parametrize("ids_dtype", [np.int32, np.uint32])
def test_matmul_id_checks_extents_before_copying(cpu, ggml_type, ids_dtype):
    w = np.zeros((4, 8, 32), np.float32) if ggml_type is None else np.zeros((4, 8, 18), np.uint8)
    op = "dense_matmul_id" if ggml_type is None else "quantized_matmul_id_ggml"
    x = virtual(np.float32(1), (HUGE, 32))
    with pytest.raises(routemm.InvalidArgumentError, match=f"{op} m must be a u32, got {HUGE}"):
        routemm.matmul_id(w, x, virtual(ids_dtype(0), (HUGE, 2)), ggml_type=ggml_type, device=cpu)
    with pytest.raises(routemm.InvalidArgumentError, match="flattened routed rows exceed the u32 kernel ABI"):
        routemm.matmul_id(w, x[: 2**31], virtual(ids_dtype(0), (2**31, 2)), ggml_type=ggml_type, device=cpu)


def test_moe_gate_checks_extents_before_copying(cpu):
    with pytest.raises(routemm.InvalidArgumentError, match=r"moe_gate router_logits shape \(1, 4294967297\)"):
        routemm.moe_gate(virtual(np.float32(0), (1, 2**32 + 1)), 1, renormalize=True, device=cpu)
    with pytest.raises(routemm.InvalidArgumentError, match=rf"moe_gate router_logits shape \({HUGE}, 4\)"):
        routemm.moe_gate(virtual(np.float32(0), (HUGE, 4)), 1, renormalize=True, device=cpu)


@pytest.mark.parametrize("ggml_type", [None, GgmlType.Q8_0])
def test_moe_experts_checks_extents_before_copying(cpu, ggml_type):
    h = i = 32
    if ggml_type is None:
        gate_up, down = np.zeros((4, 2 * i, h), np.float32), np.zeros((4, h, i), np.float32)
    else:
        gate_up, down = np.zeros((4, 2 * i, 34), np.uint8), np.zeros((4, h, 34), np.uint8)
    call = routemm.moe_experts
    with pytest.raises(routemm.InvalidArgumentError, match=f"m must be a u32, got {HUGE}"):
        call(virtual(np.float32(0), (HUGE, h)), virtual(np.int32(0), (HUGE, 2)), virtual(np.float32(0), (HUGE, 2)),
             gate_up, down, ggml_type=ggml_type, device=cpu)  # fmt: skip
    with pytest.raises(routemm.InvalidArgumentError, match="flattened routed rows exceed the u32 kernel ABI"):
        call(virtual(np.float32(0), (2**31, h)), virtual(np.int32(0), (2**31, 2)),
             virtual(np.float32(0), (2**31, 2)), gate_up, down, ggml_type=ggml_type, device=cpu)  # fmt: skip
    big = (2**20, 2 * i, h) if ggml_type is None else (2**20, 2 * i, 34)
    huge_experts = virtual(np.zeros((), gate_up.dtype), (2**33, *big[1:]))
    with pytest.raises(routemm.InvalidArgumentError, match="n_experts must be a u32"):
        call(np.zeros((2, h), np.float32), np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32), huge_experts,
             virtual(np.zeros((), down.dtype), (2**33, *down.shape[1:])), ggml_type=ggml_type, device=cpu)  # fmt: skip


# ---- argument types ---------------------------------------------------------------------------------


def assert_type_refusal(call, *fragments: str) -> None:
    with pytest.raises(routemm.InvalidArgumentTypeError) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_capabilities_refuse_what_is_not_params(cpu):
    slots = (cpu.command_encoder(), routemm.KernelRegistry(cpu), cpu.alloc(4, DType.F32), cpu.alloc(4, DType.U8),
             cpu.alloc(4, DType.F32))  # fmt: skip
    for bad in (None, {"m": 1}, np.zeros(3)):
        assert_type_refusal(
            lambda: routemm.quantized_matmul_id_ggml_capability(bad),
            "quantized_matmul_id_ggml params must be a GgmlQuantizedMatmulIdParams",
        )
        assert_type_refusal(
            lambda: routemm.dense_matmul_id_capability(DType.F32, bad), "dense_matmul_id params must be"
        )
        assert_type_refusal(
            lambda: routemm.quantized_matmul_ggml(*slots, bad),
            "quantized_matmul_ggml params must be a GgmlQuantizedMatmulParams",
        )


@pytest.mark.parametrize("slot", ["encoder", "registry", "input", "weight", "output"])
@pytest.mark.parametrize("bad", [None, "array"])
def test_quantized_matmul_ggml_refuses_wrong_types_by_name(cpu, slot, bad):
    args = dict(
        encoder=cpu.command_encoder(),
        registry=routemm.KernelRegistry(cpu),
        input=cpu.from_numpy(np.ones((9, 32), np.float32)),
        weight=cpu.from_numpy(np.zeros((4, 18), np.uint8)),
        output=poisoned(cpu, 9, 4),
    )
    args[slot] = np.zeros((9, 32), np.float32) if bad == "array" else None
    params = routemm.GgmlQuantizedMatmulParams(9, 4, 32)
    for op, front_door in (
        ("quantized_matmul_ggml", lambda: routemm.quantized_matmul_ggml(**args, params=params)),
        ("encode_q4_route", lambda: routemm.encode_q4_route(**args, params=params, route="compatibility_v2")),
    ):
        assert_type_refusal(front_door, f"{op} {slot} must be a")


def test_moe_kernels_refuse_wrong_types_and_ranges_by_name(cpu):
    registry = routemm.KernelRegistry(cpu)
    encoder = cpu.command_encoder()
    logits = cpu.from_numpy(np.zeros((2, 4), np.float32))
    weights, ids = poisoned(cpu, 2, 2), cpu.alloc(16, DType.U32, [2, 2])
    rows, out = cpu.alloc(4 * 8 * 4, DType.F32, [4, 8]), poisoned(cpu, 2, 8)
    gate = routemm.encode_moe_gate
    assert_type_refusal(lambda: gate(None, registry, logits, weights, ids, top_k=2, renormalize=True), "encoder")
    assert_type_refusal(lambda: gate(encoder, registry, None, weights, ids, top_k=2, renormalize=True), "logits")
    assert_type_refusal(lambda: gate(encoder, registry, logits, np.zeros((2, 2)), ids, top_k=2, renormalize=True),
                        "moe_gate weights must be a Buffer, not ndarray")  # fmt: skip
    combine = routemm.encode_moe_combine
    assert_type_refusal(lambda: combine(encoder, None, rows, weights, ids, out, n_experts=4), "moe_combine registry")
    assert_type_refusal(lambda: combine(encoder, registry, rows, None, ids, out, n_experts=4), "moe_combine weights")
    assert_type_refusal(lambda: combine(encoder, registry, rows, weights, ids, [0.0], n_experts=4), "output")
    for n_experts in (-1, 2**32, 2.5, "4", True, None):
        with pytest.raises(
            routemm.InvalidArgumentError, match=f"moe_combine n_experts must be a u32, got {n_experts!r}"
        ):
            combine(encoder, registry, rows, weights, ids, out, n_experts=n_experts)
    silu = routemm.encode_moe_silu_mul
    assert_type_refusal(lambda: silu(encoder, registry, rows, None, rows, rows=1, width=8, gate_row_stride=8,
                                     up_row_stride=8), "moe_silu_mul up must be a Buffer")  # fmt: skip
    for field, value in (("rows", -1), ("width", 2**32), ("gate_row_stride", 2**64), ("up_row_stride", 1.5)):
        sizes = dict(rows=1, width=8, gate_row_stride=8, up_row_stride=8)
        sizes[field] = value
        with pytest.raises(routemm.InvalidArgumentError, match=f"moe_silu_mul {field} must be a u(32|64), got"):
            silu(encoder, registry, rows, rows, out, **sizes)
    assert encoder.pending_dispatches == 0
    assert_poisoned(out, "moe output")


def test_moe_gate_and_experts_take_lists_as_arrays(cpu):
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate router_logits must be float32, got float64"):
        routemm.moe_gate([[1.0, 2.0]], 1, renormalize=True, device=cpu)
    _, ids = routemm.moe_gate(np.array([[1.0, 2.0]], np.float32), 1, renormalize=True, device="cpu")
    assert ids.tolist() == [[1]]
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate router_logits must be 2-D"):
        routemm.moe_gate(None, 1, renormalize=True, device=cpu)
    with pytest.raises(routemm.InvalidArgumentError, match="device must be a routemm.Device or a backend name"):
        routemm.moe_gate(np.zeros((1, 2), np.float32), 1, renormalize=True, device=np.zeros(2))
    x = np.zeros((1, 32), np.float32)
    down = np.zeros((2, 32, 32), np.float32)
    with pytest.raises(routemm.InvalidArgumentError, match="moe_experts down must be"):
        routemm.moe_experts(x, [[0]], np.ones((1, 1), np.float32), np.zeros((2, 64, 32), np.float32), None, device=cpu)
    # A list is an array: of float64 here, which the device has no dtype for.
    with pytest.raises(routemm.InvalidArgumentError, match="float64"):
        routemm.moe_experts(x, [[0]], np.ones((1, 1), np.float32), np.zeros((2, 64, 32), np.float32), down.tolist(),
                            device=cpu)  # fmt: skip
    out = routemm.moe_experts(
        x, [[0]], np.ones((1, 1), np.float32), np.zeros((2, 64, 32), np.float32), down, device="cpu"
    )
    assert out.shape == (1, 32)


@pytest.mark.parametrize("fmt", [routemm.q4_0, routemm.q8_0], ids=["q4_0", "q8_0"])
@pytest.mark.parametrize(
    "shape", [(2**64, 32), (32.5,), ("32",), (True, 32), (-1, -32), (np.float32(32),), 32, {"not": 32}], ids=repr
)
def test_dequantize_refuses_shapes_that_are_not_extents(fmt, shape):
    blocks = fmt.quantize(np.zeros(32, np.float32))
    with pytest.raises(routemm.InvalidArgumentError, match=f"{fmt.__name__.rsplit('.', 1)[1]} dequantize: shape"):
        fmt.dequantize(blocks, shape=shape)
    if shape != (2**64, 32):  # a shape, if of no array that fits memory
        with pytest.raises(routemm.InvalidArgumentError, match="shape"):
            fmt.quantized_shape(shape)
    assert fmt.dequantize(blocks, shape=[np.int64(1), 32]).shape == (1, 32)


@pytest.mark.parametrize("version", [0, 99, "1", True, None])
def test_quantized_expert_id_params_refuse_another_schema_version(version):
    with pytest.raises(routemm.InvalidArgumentError, match="schema_version"):
        routemm.GgmlQuantizedMatmulIdParams(1, 4, 32, 1, 1, GgmlType.Q4_0, 72, schema_version=version)
    params = routemm.GgmlQuantizedMatmulIdParams(1, 4, 32, 1, 1, GgmlType.Q4_0, 72)
    assert params.to_dict()["schema_version"] == routemm.ops.quantized_matmul_id.SCHEMA_VERSION
