"""Fail closed at the front doors: a refused call leaves the encoder as it was.

  * Every front door that encodes more than one dispatch (the grouped routes of dense_matmul_id and
    quantized_matmul_id_ggml, moe_experts, a captured graph's replay) is all or nothing: after a
    refused call the encoder holds the same pending dispatches, the process counters did not move
    and a commit writes nothing the call would have written (a poisoned output stays poisoned).

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
