"""What a user meets first: messages that name the supported alternatives in the caller's own terms,
schema validation as public API, and the conveniences of the array-level calls."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from support import distinct_ids

# ---- the public namespace -------------------------------------------------------------------------


def test_public_namespace_holds_only_the_api():
    import types

    extra = {
        name
        for name in dir(routemm)
        if not name.startswith("_")
        and name not in routemm.__all__
        and name != "logger"
        and not isinstance(getattr(routemm, name), types.ModuleType)
    }
    assert extra == set(), f"names outside __all__: {sorted(extra)}"
    assert "annotations" not in dir(routemm)


# ---- schemas -------------------------------------------------------------------------------------


def test_schemas_validate_is_public(device):
    pytest.importorskip("jsonschema")
    assert "schemas" in routemm.__all__ and "dense_q4_calibration_receipt.schema.json" in routemm.schemas.names()
    record = routemm.DenseMatmulIdParams(4, 8, 16, 2, 4, 8 * 16 * 4)
    routemm.schemas.validate(record)
    routemm.schemas.validate(record.to_dict(), record.SCHEMA)
    # A record described by a part of its schema file is checked against that part.
    routemm.schemas.validate(routemm.DenseQ4BaseShape(64, 128))


def test_schemas_validate_reports_every_violation():
    jsonschema = pytest.importorskip("jsonschema")
    doc = {**routemm.DenseMatmulIdParams(4, 8, 16, 2, 4, 512).to_dict(), "m": -1, "surprise": 1}
    with pytest.raises(jsonschema.ValidationError, match="surprise") as raised:
        routemm.schemas.validate(doc, routemm.DenseMatmulIdParams.SCHEMA)
    assert "-1" in str(raised.value)


def test_schemas_validate_names_what_it_needs():
    pytest.importorskip("jsonschema")
    with pytest.raises(routemm.InvalidArgumentError, match="needs the schema name"):
        routemm.schemas.validate({"m": 1})
    with pytest.raises(routemm.InvalidArgumentError, match="no schema 'nope.json'"):
        routemm.schemas.validate({"m": 1}, "nope.json")


def test_schemas_validate_without_jsonschema_says_how_to_install(monkeypatch):
    import routemm.core._schemas

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema now raises ImportError
    routemm.core._schemas._validator.cache_clear()
    try:
        with pytest.raises(routemm.MissingDependencyError, match=r"routemm\[schemas\]") as raised:
            routemm.schemas.validate(routemm.DenseMatmulIdParams(4, 8, 16, 2, 4, 512))
        assert isinstance(raised.value, ImportError) and isinstance(raised.value, routemm.Error)
    finally:
        routemm.core._schemas._validator.cache_clear()


def test_schemas_extra_brings_jsonschema():
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    extras = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^schemas = \["jsonschema>=4\.18"\]', extras, re.MULTILINE)


# ---- dtypes and DLPack ---------------------------------------------------------------------------


def test_from_numpy_int64_lists_dtypes_and_suggests_uint32_ids(device):
    with pytest.raises(routemm.InvalidArgumentError) as raised:
        device.from_numpy(np.arange(4, dtype=np.int64))
    message = str(raised.value)
    assert "int64" in message and "uint32" in message and "float32" in message and "bfloat16" in message
    assert "astype(np.uint32)" in message


def test_from_numpy_float64_suggests_float32(device):
    with pytest.raises(routemm.InvalidArgumentError, match=r"astype\(np.float32\)"):
        device.from_numpy(np.zeros(3))


@pytest.mark.parametrize("dtype,name", [(np.float64, "float64"), (np.int64, "int64"), (np.bool_, "bool8")])
def test_from_dlpack_names_the_dtype(device, dtype, name):
    if not device.host_accessible:
        pytest.skip("NumPy arrays are DLPack tensors on the CPU")
    with pytest.raises(routemm.InvalidArgumentError) as raised:
        routemm.from_dlpack(np.zeros(4, dtype))
    assert f"from_dlpack: {name} has no routemm dtype" in str(raised.value)
    assert "DLPack code" not in str(raised.value) and "float32" in str(raised.value)


def test_from_dlpack_not_contiguous_speaks_numpy(device):
    if not device.host_accessible:
        pytest.skip("NumPy arrays are DLPack tensors on the CPU")
    with pytest.raises(routemm.InvalidArgumentError, match=r"np\.ascontiguousarray"):
        routemm.from_dlpack(np.zeros((4, 6), np.float32)[:, ::2])


# ---- Device.alloc --------------------------------------------------------------------------------


def test_alloc_infers_nbytes_from_shape(device):
    buf = device.alloc(dtype=DType.F32, shape=[4, 8])
    assert (buf.nbytes, buf.dtype, buf.shape) == (128, DType.F32, (4, 8))
    assert device.alloc(dtype=DType.BF16, shape=(3,)).nbytes == 6
    assert device.alloc(dtype=DType.U8, shape=[0]).nbytes == 0
    assert device.alloc(64, DType.U32).shape == (16,)  # the positional form is unchanged


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dtype=DType.F32), "needs nbytes, or a shape"),
        (dict(dtype=DType.F32, shape=[4, -1]), "non-negative integers"),
        (dict(dtype=DType.F32, shape=[2.5]), "non-negative integers"),
        (dict(dtype=DType.F32, shape=8), "a list or tuple of extents"),
        (dict(dtype=DType.F32, shape=[2**32, 2**32]), "over 2\\^64 - 1"),
        (dict(shape=[4]), "dtype must be a routemm.DType"),
        (dict(nbytes=16, dtype=DType.F32, shape=[5]), "holds 5 elements"),  # the core checks the two agree
        (dict(nbytes=-4, dtype=DType.F32), "alloc nbytes must be a u64, got -4"),
        (dict(nbytes=2**64, dtype=DType.F32), "alloc nbytes must be a u64, got 18446744073709551616"),
        (dict(nbytes=16.0, dtype=DType.F32), "alloc nbytes must be a u64, got 16.0"),
        (dict(nbytes="16", dtype=DType.F32), "alloc nbytes must be a u64, got '16'"),
        (dict(nbytes=16, dtype=DType.F32, shape=[4, -1]), "alloc: shape extents must be non-negative integers"),
    ],
)
def test_alloc_refuses_what_it_cannot_size(device, kwargs, message):
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        device.alloc(**kwargs)


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: routemm.DenseMatmulIdParams(m=-1, n=8, k=32, top_k=1, n_experts=2, expert_stride_bytes=1024),
            "dense_matmul_id m must be a u32, got -1",
        ),
        (
            lambda: routemm.DenseMatmulIdParams(m=1, n=8, k=32, top_k=1, n_experts=2, expert_stride_bytes=-1),
            "dense_matmul_id expert_stride_bytes must be a u64, got -1",
        ),
        (
            lambda: routemm.DenseMatmulIdParams(
                m=1, n=8, k=32, top_k=1, n_experts=2, expert_stride_bytes=1024, route="fastest"
            ),
            "dense_matmul_id route must be one of",
        ),
        (
            lambda: routemm.GgmlQuantizedMatmulParams(m=1, n=-256, k=32),
            "quantized_matmul_ggml n must be a u32, got -256",
        ),
        (
            lambda: routemm.GgmlQuantizedMatmulParams(m=1.5, n=256, k=32),
            "quantized_matmul_ggml m must be a u32, got 1.5",
        ),
        (
            lambda: routemm.GgmlQuantizedMatmulIdParams(
                m=1, n=8, k=-32, top_k=1, n_experts=2, ggml_type=routemm.GgmlType.Q4_0, expert_stride_bytes=144
            ),
            "quantized_matmul_id_ggml k must be a u32, got -32",
        ),
    ],
    ids=["dense_m", "dense_stride", "dense_route", "ggml_n", "ggml_m_float", "ggml_id_k"],
)
def test_params_refuse_bad_fields_at_construction(make, message):
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        make()


def test_expert_id_params_check_and_cache_through_one_mechanism():
    """DenseMatmulIdParams and GgmlQuantizedMatmulIdParams define only how their native params are
    built (`_native`); the construction-time check and the once-built cache are one shared
    mechanism, so the two records cannot drift apart."""
    from routemm.ops.dense_matmul_id import _NativeParams

    made = (
        routemm.DenseMatmulIdParams(m=2, n=8, k=32, top_k=1, n_experts=2, expert_stride_bytes=1024),
        routemm.GgmlQuantizedMatmulIdParams(
            m=2, n=8, k=32, top_k=1, n_experts=2, ggml_type=routemm.GgmlType.Q4_0, expert_stride_bytes=144
        ),
    )
    for params in made:
        kind = type(params)
        assert issubclass(kind, _NativeParams)
        assert {"__post_init__", "_native_params"}.isdisjoint(vars(kind)) and "_native" in vars(kind)
        assert "_native_params" not in vars(params)  # checked at construction, built at first use
        assert kind(**vars(params)) == params
        assert params._native_params is params._native_params


# ---- KernelRegistry.get_pipeline -----------------------------------------------------------------


@pytest.mark.parametrize("constants", [[1], [(700,)], [(700, 1, 2)], 5, [("a", 1)]], ids=str)
def test_get_pipeline_explains_constant_pairs(registry, constants):
    with pytest.raises(routemm.InvalidArgumentError, match=r"\(index, value\) pairs"):
        registry.get_pipeline("dense_matmul_id_map_distinct", constants)


def test_get_pipeline_constant_ranges(registry):
    with pytest.raises(routemm.InvalidArgumentError, match="the index is a u32, the value an i32"):
        registry.get_pipeline("dense_matmul_id_map_distinct", [(700, 2**31)])
    assert registry.get_pipeline("dense_matmul_id_map_distinct", [(700, 1)]).label.endswith("|700:i1")
    assert registry.get_pipeline("dense_matmul_id_map_distinct", ((700, 1),)).label.endswith("|700:i1")


# ---- matmul_id -----------------------------------------------------------------------------------


# m = 16 routes 32 rows to 4 experts: grouped_prefill is the automatic route on every backend (CUDA
# groups from 8 rows per expert; routemm.dense_matmul_id.auto_grouped).
def _case(rng, m=16, top_k=2, n=8, k=16, experts=4):
    w = rng.standard_normal((experts, n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return w, x, distinct_ids(rng, m, top_k, experts)


@pytest.mark.parametrize(
    "m,route,expected", [(16, None, Route.GROUPED_PREFILL), (3, None, Route.DIRECT), (16, Route.DIRECT, Route.DIRECT)]
)
def test_matmul_id_returns_the_receipt_of_the_route_taken(device, rng, m, route, expected):
    w, x, ids = _case(rng, m=m)
    out, receipt = routemm.matmul_id(w, x, ids, route=route, device=device, return_receipt=True)
    assert isinstance(receipt, routemm.DenseMatmulIdDispatchReceipt)
    assert receipt.route is expected and receipt.weight_dtype is DType.F32
    assert receipt.dispatch_count == (2 if expected.is_grouped else 1)
    assert np.array_equal(out, routemm.matmul_id(w, x, ids, route=route, device=device))


def test_matmul_id_return_receipt_with_out(device, rng):
    w, x, ids = _case(rng)
    out = np.empty((32, 8), np.float32)
    result, receipt = routemm.matmul_id(w, x, ids, out=out, device=device, return_receipt=True)
    assert result is out and receipt.route is Route.GROUPED_PREFILL


@pytest.mark.parametrize("which", ["weights", "x", "ids"])
def test_matmul_id_with_buffers_says_it_wants_arrays(device, rng, which):
    args = dict(zip(("weights", "x", "ids"), _case(rng), strict=True))
    args[which] = device.from_numpy(args[which].astype(np.uint32) if which == "ids" else args[which])
    with pytest.raises(routemm.InvalidArgumentError, match=f"{which} is a routemm.Buffer.*dense_matmul_id"):
        routemm.matmul_id(args["weights"], args["x"], args["ids"], device=device)


def test_matmul_id_wrong_m_in_ids_blames_ids(device, rng):
    w, x, ids = _case(rng, m=12)
    with pytest.raises(routemm.InvalidArgumentError, match=r"ids must be \[m, top_k\] with m = 12.*\(13, 2\)"):
        routemm.matmul_id(w, x, np.vstack([ids, ids[:1]]), device=device)


@pytest.mark.parametrize(
    "x_shape,message",
    [((12, 15), r"x must be \[m, 16\] or \[m, top_k, 16\]"), ((12, 3, 16), "3 slots per token but ids")],
)
def test_matmul_id_wrong_x_blames_x(device, rng, x_shape, message):
    w, _, ids = _case(rng, m=12)
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.matmul_id(w, np.zeros(x_shape, np.float32), ids, device=device)


def test_matmul_id_receipt_travels_as_json(device, rng):
    _, receipt = routemm.matmul_id(*_case(rng), device=device, return_receipt=True)
    assert json.loads(receipt.to_json())["route"] == "grouped_prefill"


def test_matmul_id_receipt_for_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    w, x, ids = (torch.from_numpy(a) for a in _case(rng))
    out, receipt = routemm.matmul_id(w, x, ids.to(torch.int32), return_receipt=True)
    assert isinstance(out, torch.Tensor) and out.shape == (32, 8)
    assert receipt.route is Route.GROUPED_PREFILL and receipt.dispatch_count == 2


def test_from_dlpack_names_a_torch_dtype():
    torch = pytest.importorskip("torch")
    with pytest.raises(routemm.InvalidArgumentError, match="from_dlpack: float64 has no routemm dtype"):
        routemm.from_dlpack(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(routemm.InvalidArgumentError, match=r"t\.contiguous\(\)"):
        routemm.from_dlpack(torch.zeros((4, 6)).t())
