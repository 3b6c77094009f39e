"""Standing guards (hypothesis): mutated inputs to the file and record loaders are either accepted
correctly or refused with a routemm.Error -- never another exception.

* `from_json` of every record class, on mutations of a real document: accepted exactly when the
  `jsonschema` package (draft 2020-12, with ECMA-262 pattern anchors) accepts it, and an accepted
  record round-trips to an equal record.
* gguf_tensor on byte mutations of a small file, mapped and copied: a loaded tensor sits at an
  8-byte-aligned address and reads back.
* MoeLayer.from_gguf with each metadata key it reads given every GGUF value type (or left out): a
  layer that uses the value exactly, or a routemm.Error naming the key; and on byte mutations of a
  MoE file: a layer that runs, or a routemm.Error.
* Plan-file reloads on mutations of saved plan files of every kind (dense Q4, dense and quantised
  expert-ID), with their receipt, with it null and with it removed: a reload either adopts the
  saved routes or raises PlanFileMismatch.
* Receipt mutations that no calibration writes (a number out of its field's range or written as
  another type, a decision's list emptied, shortened, repeated or tripled): always PlanFileMismatch.

Failures found are kept as explicit regressions (@example, test_record_regressions). Budgets are
small (about a minute in all on two cores); raise max_examples locally to search harder.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import struct

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
jsonschema = pytest.importorskip("jsonschema")
import routemm  # noqa: E402
import routemm.core._json as records  # noqa: E402
import routemm.core._schemas as schemas  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from routemm import calibration as cal  # noqa: E402
from routemm import q4_0  # noqa: E402
from routemm.plans import dense_matmul_id_plan as dp  # noqa: E402
from routemm.plans import dense_q4_plan as dq  # noqa: E402
from support import MOE_DEFAULT_META, MOE_E, MOE_H, gguf_bytes, moe_gguf_bytes  # noqa: E402

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


# ---- Sample documents of every record class ------------------------------------------------------


def _record_classes() -> list[type]:
    def walk(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)

    return sorted(set(walk(records.JsonRecord)), key=lambda c: c.__name__)


def _collect(record, out: dict) -> None:
    out.setdefault(type(record), record)
    for value in record.__dict__.values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, records.JsonRecord):
                _collect(item, out)


@functools.lru_cache(maxsize=None)
def samples() -> dict:
    """One real record of every class, from CPU calibrations and calls (class -> record)."""
    device = routemm.Device("cpu")
    rng = np.random.default_rng(11)
    out: dict = {}
    # Q4: a calibrated plan, its receipt and a dispatch trace.
    n, k, m = 64, 64, 32
    blocks = q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    w = device.from_numpy(blocks.reshape(-1))
    registry = routemm.KernelRegistry(device)
    plan, receipt = routemm.calibrate_dense_q4_routes(
        registry, device, 1, None, [routemm.DenseQ4CalibrationCase(w, routemm.DenseQ4BaseShape(n, k), (m,))]
    )
    x = device.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = device.alloc(m * n * 4, routemm.DType.F32, [m, n])
    params = routemm.GgmlQuantizedMatmulParams(m, n, k)
    enc = device.command_encoder()
    trace = routemm.trace_dense_q4_auto(enc, registry, device, x, w, y, params, routemm.GgmlRoutingPolicy())
    q4_receipt = routemm.quantized_matmul_ggml(enc, registry, x, w, y, params, routemm.GgmlRoutingPolicy())
    enc.commit_and_wait()
    # Expert-ID: a calibrated plan, its receipt and an automatic dispatch.
    ew = device.from_numpy(rng.standard_normal((8, 7, 24)).astype(np.float32))
    p = routemm.DenseMatmulIdParams(9, 7, 24, 2, 8, 7 * 24 * 4)
    id_registry = routemm.KernelRegistry(device)
    id_plan, id_receipt = routemm.calibrate_dense_matmul_id_routes(
        id_registry, device, 1, None, [routemm.DenseMatmulIdCalibrationCase(ew, p)]
    )
    xi = device.from_numpy(rng.standard_normal((9, 24)).astype(np.float32))
    ids = device.from_numpy(np.tile(np.arange(2, dtype=np.uint32), (9, 1)))
    out_i = device.alloc(9 * 2 * 7 * 4, routemm.DType.F32, [18, 7])
    enc = device.command_encoder()
    auto = routemm.dense_matmul_id_auto(
        enc, id_registry, device, ew, xi, ids, out_i, routemm.DenseMatmulIdScratch(device, 8, 9), p, activation_epoch=1
    )
    id_trace = routemm.trace_dense_matmul_id_auto(
        enc, id_registry, device, ew, xi, ids, out_i, routemm.DenseMatmulIdScratch(device, 8, 9), p, activation_epoch=1
    )
    enc.commit_and_wait()
    grouped = routemm.dense_matmul_id_capability(
        routemm.DType.BF16,
        routemm.DenseMatmulIdParams(9, 7, 35, 6, 8, 504, route=routemm.DenseMatmulIdRoute.GROUPED_PREFILL),
    )
    # Quantised expert-ID: params, capability and a dispatch receipt (grouped, Q8_0).
    qp = routemm.GgmlQuantizedMatmulIdParams(
        9, 8, 64, 2, 4, routemm.GgmlType.Q8_0, 8 * 2 * 34, route=routemm.GgmlQuantizedMatmulIdRoute.GROUPED
    )
    qw = device.from_numpy(routemm.q8_0.quantize(rng.standard_normal((4, 8, 64)).astype(np.float32)).reshape(-1))
    qx = device.from_numpy(rng.standard_normal((9, 64)).astype(np.float32))
    qids = device.from_numpy(np.tile(np.array([1, 3], dtype=np.uint32), (9, 1)))
    q_out = device.alloc(9 * 2 * 8 * 4, routemm.DType.F32, [18, 8])
    enc = device.command_encoder()
    q_receipt = routemm.quantized_matmul_id_ggml(
        enc, registry, qx, qw, qids, q_out, routemm.DenseMatmulIdScratch(device, 4, 9), qp
    )
    enc.commit_and_wait()
    # Quantised expert-ID calibration (timed, so the receipt carries timings) and an auto call.
    q_registry = routemm.KernelRegistry(device)
    q_plan, q_cal = routemm.calibrate_quantized_matmul_id_routes(
        q_registry, device, 1, None, [routemm.GgmlQuantizedMatmulIdCalibrationCase(qw, qp)]
    )
    enc = device.command_encoder()
    q_auto = routemm.quantized_matmul_id_ggml_auto(
        enc, q_registry, device, qx, qw, qids, q_out, routemm.DenseMatmulIdScratch(device, 4, 9), qp, activation_epoch=1
    )
    enc.commit_and_wait()
    extra = [
        q_plan,
        q_cal,
        q_auto,
        qp,
        routemm.quantized_matmul_id_ggml_capability(qp),
        q_receipt,
        plan,
        receipt,
        trace,
        q4_receipt,
        params,
        id_plan,
        id_receipt,
        auto,
        id_trace,
        p,
        grouped,
        routemm.dense_matmul_id_capability(routemm.DType.F32, p),
        dq.DenseQ4BaseShape(n, k),
        dq.select_route(registry, device, params),
    ]
    for record in extra:
        _collect(record, out)
    return out


def test_samples_cover_every_record_class():
    assert set(_record_classes()) <= set(samples())


# ---- Reference: the jsonschema package ------------------------------------------------------------


def _ecma_pattern(validator, pattern, instance, schema):
    """`pattern` with ECMA-262 anchors ($ at the very end), as the built-in checker reads it."""
    anchored = pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
    if validator.is_type(instance, "string") and not re.search(anchored, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Reference = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _ecma_pattern})


@functools.lru_cache(maxsize=None)
def reference(cls: type):
    root = schemas.load(cls.SCHEMA)
    part = schemas.record_definition(cls.SCHEMA, cls.__name__)
    schema = root if part is None else {**root["$defs"][part], "$defs": root.get("$defs", {})}
    return _Reference(schema)


# ---- Mutations of JSON documents ---------------------------------------------------------------


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, (*prefix, i))


@functools.lru_cache(maxsize=None)
def _schema_words() -> tuple:
    """Every string the schemas name (enum values, consts, property names): near-valid values."""
    words = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                words.add(key)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str) and len(node) < 80:
            words.add(node)

    for name in schemas.names():
        walk(schemas.load(name))
    return tuple(sorted(words))


def _values(current):
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([0, 1, -1, 3, 2**31, 2**32, 2**32 - 1, 2**63, 2**64 - 1, 2**64, -(10**30), 10**30]),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from(_schema_words()),
        st.sampled_from(["", "0" * 64, "f" * 64, "zz", "0" * 64 + "\n", "F" * 64]),
        st.text(max_size=8),
    )
    near = [scalars]
    if isinstance(current, bool):
        near.append(st.just(not current))
    elif isinstance(current, int):
        near.append(st.sampled_from([current + 1, current - 1, float(current), -current, str(current)]))
    elif isinstance(current, float):
        near.append(st.sampled_from([current * 2, -current, 0, int(current)]))
    composite = st.one_of(st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=4), scalars, max_size=3))
    return st.one_of(*near, composite)


@st.composite
def mutated(draw, doc):
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        current = parent[path[-1]] if path else doc
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "duplicate"]))
        if not path:
            if op == "replace":
                doc = draw(_values(doc))
            continue
        if op == "replace":
            parent[path[-1]] = draw(_values(current))
        elif op == "delete":
            del parent[path[-1]]
        elif op == "add" and isinstance(current, dict):
            current[draw(st.sampled_from(_schema_words()))] = draw(_values(None))
        elif op == "add" and isinstance(current, list):
            current.append(copy.deepcopy(current[0]) if current else draw(_values(None)))
        elif op == "duplicate" and isinstance(current, list) and current:
            current.insert(0, copy.deepcopy(current[-1]))
    return doc


def _check_record(cls, doc) -> None:
    text = json.dumps(doc)
    valid = reference(cls).is_valid(doc)
    try:
        record = cls.from_json(text)
    except routemm.Error as e:
        assert not valid, f"{cls.__name__} refused a schema-valid document: {e}"
        return
    assert valid, f"{cls.__name__} accepted a document its schema refuses: {text}"
    assert cls.from_json(record.to_json()) == record
    assert reference(cls).is_valid(record.to_dict())


@pytest.mark.parametrize("cls", _record_classes(), ids=lambda c: c.__name__)
def test_record_from_json_agrees_with_its_schema(cls):
    doc = samples()[cls].to_dict()

    @settings(max_examples=60, **SETTINGS)
    @given(mutated(doc))
    def check(document):
        _check_record(cls, document)

    check()


@pytest.mark.parametrize(
    "cls,patch",
    [
        (routemm.DenseMatmulIdParams, {"m": 9.0}),  # an integral number is an integer in JSON Schema
        (routemm.PipelineIdentity, {"content_sha256": "0" * 64 + "\n"}),  # $ ends the string
        (routemm.EncodedKernelDispatch, {"grid": [1, 1, 1, 1]}),  # prefixItems with items: false
        (routemm.GgmlQuantizedMatmulReceipt, {"route": "mat_vec"}),  # if/then refines the route
    ],
    ids=["integral-float", "trailing-newline", "extra-item", "if-then"],
)
def test_record_regressions(cls, patch):
    _check_record(cls, {**samples()[cls].to_dict(), **patch})


# ---- GGUF byte mutations -----------------------------------------------------------------------


_GGUF = gguf_bytes(
    kvs=[
        ("general.alignment", 4, struct.pack("<I", 32)),
        ("general.name", 8, struct.pack("<Q", 4) + b"tiny"),
        ("tokens", 9, struct.pack("<IQ", 8, 2) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 1) + b"b"),
    ],
    tensors=[("t", [8], 0, 0), ("h", [4, 2], 1, 32), ("q", [32], 2, 64)],
    data=bytes(range(96)),
)


@st.composite
def gguf_mutation(draw, original: bytes = _GGUF):
    blob = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["byte", "word", "truncate", "insert"]))
        at = draw(st.integers(0, len(blob) - 1))
        if op == "byte":
            blob[at] = draw(st.integers(0, 255))
        elif op == "word" and at + 8 <= len(blob):
            word = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 64, 5, 9]))
            blob[at : at + 8] = struct.pack("<Q", word)
        elif op == "truncate":
            del blob[at:]
        elif op == "insert":
            blob[at:at] = draw(st.binary(min_size=1, max_size=16))
        if not blob:
            break
    return bytes(blob)


@settings(max_examples=300, **SETTINGS)
@given(gguf_mutation(), st.sampled_from(["t", "h", "q"]), st.booleans())
@example(_GGUF[:20], "t", False)
@example(_GGUF.replace(struct.pack("<I", 32), struct.pack("<I", 0), 1), "t", False)  # alignment 0
@example(_GGUF.replace(struct.pack("<I", 32), struct.pack("<I", 1), 1), "q", False)  # alignment 1
@example(gguf_bytes(tensors=[("t", [32], 2, 1)], data=bytes(64)), "t", False)  # Q4_0 at an odd offset
@example(gguf_bytes(tensors=[("t", [0, 2**61], 0, 0)]), "t", False)  # zero-size, 2^63 bytes
@example(gguf_bytes(tensors=[("t", [8], 0, 0), ("t", [4], 0, 0)]), "t", False)  # a name twice
@example(gguf_bytes([("k", 4, struct.pack("<I", 1))] * 2), "t", False)  # a key twice
def test_gguf_mutations_load_or_refuse(tmp_path_factory, blob, name, copy_):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    path.write_bytes(blob)
    try:
        buf = routemm.gguf_tensor(path, name, device=routemm.Device("cpu"), copy=copy_)
    except routemm.Error:
        return
    assert buf.numpy().nbytes == buf.nbytes
    if buf.nbytes:  # every kernel can read it: the address suits each dtype (and Q4_0/Q8_0 scales)
        assert (buf.address + buf.byte_offset) % 8 == 0


# ---- MoeLayer.from_gguf: metadata of every GGUF type, byte mutations ----------------------------


_MOE_KEYS = (*MOE_DEFAULT_META, "qwen3moe.expert_gating_func", "qwen3moe.expert_weights_norm")
# GGUF integer type ids and their ranges.
_GGUF_INTS = {
    0: (0, 2**8 - 1), 1: (-(2**7), 2**7 - 1), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1),
    4: (0, 2**32 - 1), 5: (-(2**31), 2**31 - 1), 10: (0, 2**64 - 1), 11: (-(2**63), 2**63 - 1),
}  # fmt: skip


@st.composite
def gguf_typed_value(draw):
    """(GGUF type id, value) of any metadata type: small and extreme integers of every width,
    floats (integral ones, NaN and infinities included), bools, strings and short arrays."""
    kind = draw(st.sampled_from(["int", "int", "float", "bool", "string", "array"]))
    if kind == "int":
        type_id = draw(st.sampled_from(sorted(_GGUF_INTS)))
        lo, hi = _GGUF_INTS[type_id]
        return type_id, draw(st.one_of(st.integers(max(lo, -1), min(hi, 9)), st.sampled_from([lo, hi])))
    if kind == "float":
        type_id = draw(st.sampled_from([6, 12]))
        near = st.sampled_from([1.0, 2.0, 2.7, 4.0, 0.0, -1.0])
        return type_id, draw(st.one_of(near, st.floats(width=32 if type_id == 6 else 64)))
    if kind == "bool":
        return 7, draw(st.booleans())
    if kind == "string":
        return 8, draw(st.one_of(st.sampled_from(["qwen3moe", "llama", "1", "2", "false", ""]), st.text(max_size=6)))
    item_type = draw(st.sampled_from([4, 7, 8]))
    items = {4: st.integers(0, 9), 7: st.booleans(), 8: st.sampled_from(["1", "qwen3moe"])}[item_type]
    return 9, (item_type, draw(st.lists(items, max_size=2)))


@settings(max_examples=200, **SETTINGS)
@given(st.sampled_from(_MOE_KEYS), st.one_of(st.none(), gguf_typed_value()))
@example("qwen3moe.expert_used_count", (6, 2.7))
@example("qwen3moe.expert_count", (12, float("nan")))
@example("qwen3moe.expert_count", (4, 1))  # fewer experts than expert_used_count
@example("qwen3moe.expert_weights_norm", (8, "false"))
@example("qwen3moe.expert_weights_norm", (9, (7, [False])))
@example("qwen3moe.expert_gating_func", (7, True))
@example("qwen3moe.expert_gating_func", (0, 0))  # llama.cpp's none: the default gate
@example("qwen3moe.expert_gating_func", (0, 2))  # sigmoid
@example("qwen3moe.expert_gating_func", (4, 3))  # softmax_weight: refused by name
def test_moe_layer_metadata_of_every_type(tmp_path_factory, key, typed):
    """One metadata value MoeLayer.from_gguf reads, replaced by any GGUF value or left out (None):
    the layer uses exactly that value (no coercion) and runs, or a routemm.Error names the key."""
    path = tmp_path_factory.mktemp("moe") / "m.gguf"
    path.write_bytes(moe_gguf_bytes({key: typed}))
    try:
        layer = routemm.MoeLayer.from_gguf(path, 0, device=routemm.Device("cpu"))
    except routemm.Error as e:
        # Another architecture string names the keys the file then lacks.
        other_arch = key == "general.architecture" and typed is not None and typed[0] == 8
        assert (f"{typed[1]}.expert_count" if other_arch else key) in str(e), str(e)
        return
    type_id, value = typed if typed is not None else (None, None)
    integer = type_id in _GGUF_INTS
    used_exactly = {
        "general.architecture": type_id == 8 and value == "qwen3moe",
        "qwen3moe.block_count": typed is None or (integer and value >= 1),
        "qwen3moe.expert_count": integer and value == MOE_E,
        "qwen3moe.expert_used_count": integer and layer.top_k == value,
        # 1 softmax, 2 sigmoid; 0 is llama.cpp's "none given": the architecture's default, softmax.
        "qwen3moe.expert_gating_func": layer.routing.scoring_func
        == ("softmax" if typed is None else {0: "softmax", 1: "softmax", 2: "sigmoid"}.get(value) if integer else None),
        "qwen3moe.expert_weights_norm": layer.renormalize is (True if typed is None else value)
        and type_id in (None, 7),
    }[key]
    assert used_exactly, (key, typed, layer.top_k, layer.renormalize)
    assert np.isfinite(layer(np.ones((2, MOE_H), np.float32))).all()


_MOE = moe_gguf_bytes()


@settings(max_examples=150, **SETTINGS)
@given(gguf_mutation(_MOE))
@example(moe_gguf_bytes({"qwen3moe.expert_count": (6, float("nan"))}))  # escaped as ValueError
@example(moe_gguf_bytes(extra_kvs=[("qwen3moe.expert_used_count", 4, 4)]))  # a key twice: last won
def test_moe_layer_file_mutations_run_or_refuse(tmp_path_factory, blob):
    """A mutated MoE file gives a layer whose calls work, or a routemm.Error at load: never a layer
    that loads and then fails."""
    path = tmp_path_factory.mktemp("moe") / "m.gguf"
    path.write_bytes(blob)
    try:
        layer = routemm.MoeLayer.from_gguf(path, 0, device=routemm.Device("cpu"))
    except routemm.Error:
        return
    assert layer(np.ones((3, layer.hidden), np.float32)).shape == (3, layer.hidden)


# ---- Plan-file mutations -----------------------------------------------------------------------


def _winner(slow: str):
    """A timing hook under which every candidate beats the route named `slow`."""

    def timer(route, round_index, measured):
        wall, gpu = (100, 90) if route == slow else (70, 60)
        return wall - 2 + round_index, gpu - 2 + round_index

    return timer


PLAN_KINDS = ["q4", "expert_id", "quantized"]


@pytest.fixture(scope="module")
def saved_plans(tmp_path_factory):
    """{kind: (load, saved file document, cases, device, routes a plan of the kind may take)}: one
    plan of every kind, each calibrated
    afresh (the process cache emptied first, so no decision is a cache hit) with its candidate
    winning."""
    root = tmp_path_factory.mktemp("plans")
    device = routemm.Device("cpu")
    rng = np.random.default_rng(12)
    blocks = q4_0.quantize(rng.standard_normal((72, 96)).astype(np.float32))
    q4_cases = [
        routemm.DenseQ4CalibrationCase(device.from_numpy(blocks.reshape(-1)), routemm.DenseQ4BaseShape(72, 96), (9, 35))
    ]
    ew = device.from_numpy(rng.standard_normal((4, 5, 16)).astype(np.float32))
    id_cases = [routemm.DenseMatmulIdCalibrationCase(ew, routemm.DenseMatmulIdParams(11, 5, 16, 2, 4, 320))]
    stack = routemm.q8_0.quantize(rng.standard_normal((5, 6, 64)).astype(np.float32)).reshape(5, -1)
    stack = np.concatenate([stack, np.zeros((5, 6), np.uint8)], axis=1)  # an expert stride of its own
    qp = routemm.GgmlQuantizedMatmulIdParams(11, 6, 64, 2, 5, routemm.GgmlType.Q8_0, stack.shape[1])
    q_cases = [routemm.GgmlQuantizedMatmulIdCalibrationCase(device.from_numpy(np.ascontiguousarray(stack)), qp)]
    kinds = {
        "q4": (routemm.calibrate_dense_q4_routes, routemm.load_dense_q4_plan, q4_cases, "compatibility_v2"),
        "expert_id": (routemm.calibrate_dense_matmul_id_routes, routemm.load_dense_matmul_id_plan, id_cases, "direct"),
        "quantized": (
            routemm.calibrate_quantized_matmul_id_routes,
            routemm.load_quantized_matmul_id_plan,
            q_cases,
            "direct",
        ),
    }
    out = {}
    for kind, (calibrate, load, cases, slow) in kinds.items():
        cal.PROCESS_CACHE.clear()
        plan, receipt = calibrate(routemm.KernelRegistry(device), device, 2, None, cases, _timer=_winner(slow))
        assert not any(d.process_cache_hit for d in receipt.decisions)
        doc = json.loads(plan.save(root / f"{kind}.json").read_text())
        out[kind] = (load, doc, cases, device, [r.value for r in type(plan).KIND.plannable_routes])
    return out


def _routes(decisions) -> dict:
    return {json.dumps(d["shape"], sort_keys=True): d["route"] for d in decisions}


@st.composite
def flipped(draw, plan, routes):
    """`plan` with one decision's route changed to another its kind may take, and its plan id kept
    or zeroed."""
    plan = copy.deepcopy(plan)
    decision = draw(st.sampled_from(plan["decisions"]))
    decision["route"] = draw(st.sampled_from([r for r in routes if r != decision["route"]]))
    plan["plan_id"] = draw(st.sampled_from([plan["plan_id"], "0" * 64]))
    return plan


@pytest.mark.parametrize("receipt", ["kept", "null", "removed"])
@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_plan_file_mutations_reload_or_mismatch(tmp_path_factory, saved_plans, kind, receipt):
    """Every plan id covers its routes, so a reload that adopts a mutated file has the saved routes,
    with or without a receipt (a file without one is mutated in its plan)."""
    load, doc, cases, device, routes = saved_plans[kind]
    saved_routes = _routes(doc["plan"]["decisions"])
    path = tmp_path_factory.mktemp("mutated") / "plan.json"
    if receipt == "kept":
        documents = mutated(doc)
    else:
        base = {k: v for k, v in doc.items() if k != "receipt"}
        if receipt == "null":
            base["receipt"] = None
        plans = st.one_of(mutated(doc["plan"]), flipped(doc["plan"], routes))
        documents = plans.map(lambda plan: {**base, "plan": plan})

    @settings(max_examples=20 if receipt == "removed" else 50, **SETTINGS)
    @given(documents)
    def check(document):
        path.write_text(json.dumps(document))
        try:
            plan, _ = load(path, routemm.KernelRegistry(device), device, cases)
        except cal.PlanFileMismatch:
            return
        assert receipt != "removed", "a plan file without its receipt key was adopted"
        assert {json.dumps(d.shape.to_dict(), sort_keys=True): d.route.value for d in plan.decisions} == saved_routes

    check()


def _at(doc, path):
    node = doc
    for key in path:
        node = node[key]
    return node


# Fields whose range is every finite non-negative number (a relative error may be 1e300).
_UNBOUNDED = {"rel_frobenius_error", "tolerance"}


@st.composite
def bad_receipt_number(draw, doc):
    """`doc` with one number of its receipt replaced by a value its field never holds: negative, a
    boolean, beyond a u64 or a day (a bounded float field), or an integer written as a float."""
    doc = copy.deepcopy(doc)
    paths = [
        p
        for p in _paths(doc["receipt"])
        if p and isinstance(_at(doc["receipt"], p), (int, float)) and not isinstance(_at(doc["receipt"], p), bool)
    ]
    path = draw(st.sampled_from(paths))
    parent, current = _at(doc["receipt"], path[:-1]), _at(doc["receipt"], path)
    bad = [-1, -0.5, -(2**64), -1e300, True, False]
    if isinstance(current, int):
        bad += [2**64, 2**70, float(current), current + 0.5]
    elif not any(name in _UNBOUNDED for name in path if isinstance(name, str)):
        bad += [2**64, 1e308, 1e12]
    parent[path[-1]] = draw(st.sampled_from(bad))
    return doc


@st.composite
def bad_receipt_list(draw, doc):
    """`doc` with its receipt's decisions, or one decision's candidates, proofs or timings, emptied,
    shortened by one, tripled or given a repeated entry."""
    doc = copy.deepcopy(doc)
    decisions = doc["receipt"]["decisions"]
    lists = [("decisions",)] + [
        ("decisions", i, name)
        for i, d in enumerate(decisions)
        for name in ("candidates", "proofs", "timings")
        if d.get(name)
    ]
    path = draw(st.sampled_from(lists))
    parent, items = _at(doc["receipt"], path[:-1]), _at(doc["receipt"], path)
    op = draw(st.sampled_from(["empty", "drop", "triple", "repeat"]))
    at = draw(st.integers(0, len(items) - 1))
    parent[path[-1]] = {
        "empty": [],
        "drop": items[:at] + items[at + 1 :],
        "triple": items * 3,
        "repeat": items[: at + 1] + items[at:],
    }[op]
    return doc


@pytest.mark.parametrize("mutation", [bad_receipt_number, bad_receipt_list], ids=["number", "list"])
@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_receipt_mutations_are_refused(tmp_path_factory, saved_plans, kind, mutation):
    load, doc, cases, device, routes = saved_plans[kind]
    path = tmp_path_factory.mktemp("mutated") / "plan.json"

    @settings(max_examples=40, **SETTINGS)
    @given(mutation(doc))
    def check(document):
        path.write_text(json.dumps(document))
        with pytest.raises(cal.PlanFileMismatch, match="malformed calibration receipt|altered after it was saved"):
            load(path, routemm.KernelRegistry(device), device, cases)

    check()


def test_plan_module_records_are_sampled():
    assert dq.DenseQ4RoutePlan in samples() and dp.DenseMatmulIdRoutePlan in samples()
