"""JSON round trips of every record type, closed documents, schema_version checks, and the shipped
JSON Schemas themselves."""

from __future__ import annotations

import dataclasses
import json
from typing import Generic, Optional, TypeVar

import pytest
import routemm
import routemm.core._schemas as schemas
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdMultiplicity as Mult
from routemm import DenseMatmulIdRoute as Route
from routemm import DispatchKind, DType

jsonschema = pytest.importorskip("jsonschema")

EXPECTED_SCHEMAS = {
    "dense_matmul_id_capability.schema.json",
    "dense_matmul_id_dispatch_receipt.schema.json",
    "dense_matmul_id_params.schema.json",
    "encoded_kernel_dispatch.schema.json",
    "ggml_quantized_matmul_id_calibration_receipt.schema.json",
    "ggml_quantized_matmul_id_plan_auto_receipt.schema.json",
    "ggml_quantized_matmul_id_route_plan.schema.json",
    "pipeline_identity.schema.json",
}


def test_every_schema_is_valid_draft_2020_12():
    names = schemas.names()
    assert EXPECTED_SCHEMAS <= set(names)
    for name in names:
        doc = schemas.load(name)
        jsonschema.Draft202012Validator.check_schema(doc)
        assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert doc.get("additionalProperties") is False, f"{name} is not a closed document"


def _records(registry):
    params = routemm.DenseMatmulIdParams(
        9, 7, 35, 6, 8, 504, Layout.SLOTTED, Mult.DISTINCT_PER_TOKEN, Route.GROUPED_PREFILL
    )
    cap_g = routemm.dense_matmul_id_capability(DType.BF16, params)
    cap_d = routemm.dense_matmul_id_capability(
        DType.F32, routemm.DenseMatmulIdParams(1, 1, 1, 1, 1, 4, id_multiplicity=Mult.MAY_REPEAT)
    )
    receipt = routemm.DenseMatmulIdDispatchReceipt(DType.F16, Route.GROUPED_PREFILL, 2)
    disp = routemm.EncodedKernelDispatch(
        "dense_matmul_id_grouped_f16_f32", DispatchKind.THREAD_GROUPS, (2, 1, 8), (256, 1, 1), ((0, 4096),)
    )
    disp2 = routemm.EncodedKernelDispatch("k|700:i1", DispatchKind.THREADS, (1, 2, 3), (4, 5, 6), ())
    ident = registry.get_pipeline("dense_matmul_id_map_distinct", [(700, 1)]).identity
    return [params, cap_g, cap_d, receipt, disp, disp2, ident]


def test_round_trips_and_schema(registry):
    for rec in _records(registry):
        schemas.validate(rec)
        text = rec.to_json()
        assert json.loads(text) == rec.to_dict()
        back = type(rec).from_json(text)
        assert back == rec and back.to_json() == text
        assert type(rec).from_dict(rec.to_dict()) == rec


def test_json_spelling(registry):
    params, cap_g, cap_d, receipt, disp, _, ident = _records(registry)
    assert json.loads(params.to_json()) == {
        "m": 9,
        "n": 7,
        "k": 35,
        "top_k": 6,
        "n_experts": 8,
        "expert_stride_bytes": 504,
        "input_layout": "slotted",
        "id_multiplicity": "distinct_per_token",
        "route": "grouped_prefill",
        "schema_version": 3,
    }
    assert json.loads(cap_g.to_json()) == {
        "schema_version": 3,
        "weight_dtype": "bf16",
        "route": "grouped_prefill",
        "required_weight_bytes": 7 * 504 + 490,
        "required_input_bytes": 54 * 35 * 4,
        "required_ids_bytes": 216,
        "required_output_bytes": 54 * 7 * 4,
        "scratch": {"expert_counts_bytes": 32, "routed_rows_bytes": 288},
    }
    assert json.loads(cap_d.to_json())["scratch"] is None
    assert json.loads(receipt.to_json()) == {
        "schema_version": 3,
        "weight_dtype": "f16",
        "route": "grouped_prefill",
        "dispatch_count": 2,
    }
    assert json.loads(disp.to_json()) == {
        "schema_version": 1,
        "pipeline_label": "dense_matmul_id_grouped_f16_f32",
        "dispatch_kind": "thread_groups",
        "grid": [2, 1, 8],
        "threads_per_threadgroup": [256, 1, 1],
        "threadgroup_memory": [[0, 4096]],
    }
    assert json.loads(ident.to_json())["pipeline_label"] == "dense_matmul_id_map_distinct|700:i1"


def test_unknown_missing_and_version_rejected(registry):
    for rec in _records(registry):
        cls = type(rec)
        doc = rec.to_dict()
        with pytest.raises(routemm.InvalidArgumentError, match="unknown"):
            cls.from_json(json.dumps({**doc, "surprise": 1}))
        for field in doc:
            partial = {k: v for k, v in doc.items() if k != field}
            with pytest.raises(routemm.InvalidArgumentError, match="missing"):
                cls.from_json(json.dumps(partial))
        for version in (doc["schema_version"] + 1, doc["schema_version"] - 1, str(doc["schema_version"])):
            with pytest.raises(routemm.InvalidArgumentError, match="schema_version"):
                cls.from_json(json.dumps({**doc, "schema_version": version}))
        # And the schemas agree: both documents are rejected by validation too.
        with pytest.raises(jsonschema.ValidationError):
            schemas.validate({**doc, "surprise": 1}, cls.SCHEMA)
        with pytest.raises(jsonschema.ValidationError):
            schemas.validate({**doc, "schema_version": doc["schema_version"] + 1}, cls.SCHEMA)


def test_nested_scratch_unknown_field_rejected():
    params = routemm.DenseMatmulIdParams(9, 7, 35, 6, 8, 490, route=Route.GROUPED_PREFILL)
    doc = routemm.dense_matmul_id_capability(DType.BF16, params).to_dict()
    doc["scratch"]["extra"] = 0
    with pytest.raises(routemm.InvalidArgumentError, match="unknown"):
        routemm.DenseMatmulIdCapability.from_dict(doc)
    with pytest.raises(jsonschema.ValidationError):
        schemas.validate(doc, "dense_matmul_id_capability.schema.json")


@pytest.mark.parametrize(
    "cls,doc_patch",
    [
        (routemm.DenseMatmulIdParams, {"route": "grouped"}),
        (routemm.DenseMatmulIdParams, {"m": "9"}),
        (routemm.DenseMatmulIdParams, {"m": True}),
        (routemm.DenseMatmulIdDispatchReceipt, {"weight_dtype": "f64"}),
    ],
)
def test_bad_values_rejected(registry, cls, doc_patch):
    rec = {c: r for r in _records(registry) for c in [type(r)]}[cls]
    with pytest.raises(routemm.InvalidArgumentError):
        cls.from_dict({**rec.to_dict(), **doc_patch})


def test_schema_rejects_inconsistent_records():
    cap = "dense_matmul_id_capability.schema.json"
    good = routemm.dense_matmul_id_capability(DType.F32, routemm.DenseMatmulIdParams(2, 2, 2, 1, 2, 16)).to_dict()
    schemas.validate(good, cap)
    with pytest.raises(jsonschema.ValidationError):  # direct with scratch
        schemas.validate({**good, "scratch": {"expert_counts_bytes": 8, "routed_rows_bytes": 16}}, cap)
    with pytest.raises(jsonschema.ValidationError):  # grouped without scratch
        schemas.validate({**good, "route": "grouped_prefill"}, cap)
    with pytest.raises(jsonschema.ValidationError):
        schemas.validate({**good, "weight_dtype": "u32"}, cap)
    rec = "dense_matmul_id_dispatch_receipt.schema.json"
    with pytest.raises(jsonschema.ValidationError):
        schemas.validate({"schema_version": 3, "weight_dtype": "f32", "route": "direct", "dispatch_count": 2}, rec)
    ident = "pipeline_identity.schema.json"
    with pytest.raises(jsonschema.ValidationError):
        schemas.validate(
            {
                "schema_version": 1,
                "pipeline_label": "a",
                "kernel_name": "a",
                "backend": "cpu",
                "origin": "x",
                "content_sha256": "unknown",
            },
            ident,
        )


# ---- from_json accepts exactly what the shipped schema accepts --------------------------------------


def test_every_record_class_has_its_schema_part():
    import routemm.core._json as records
    import routemm.plans.dense_matmul_id_plan  # noqa: F401
    import routemm.plans.dense_q4_plan  # noqa: F401
    import routemm.plans.quantized_matmul_id_plan  # noqa: F401

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    found = list(subclasses(records.JsonRecord))
    assert len(found) >= 28
    for cls in found:
        schemas.record_definition(cls.SCHEMA, cls.__name__)  # raises LookupError when missing


@pytest.mark.parametrize(
    "cls,doc_patch,message",
    [
        (routemm.DenseMatmulIdParams, {"m": -(10**100)}, "m must be >= 0"),
        (routemm.DenseMatmulIdParams, {"expert_stride_bytes": -1}, "expert_stride_bytes must be >= 0"),
        (routemm.DenseMatmulIdParams, {"n": 2**32}, "n must be <= 4294967295"),
        (routemm.PipelineIdentity, {"backend": "f32"}, "backend must be one of"),
        (routemm.PipelineIdentity, {"content_sha256": "zz"}, "content_sha256 must match"),
        (routemm.EncodedKernelDispatch, {"grid": [1, 2]}, "grid must have at least 3 items"),
        (routemm.EncodedKernelDispatch, {"grid": [1, 2, 3, 4]}, r"grid\[3\] is not allowed"),
        (routemm.EncodedKernelDispatch, {"pipeline_label": ""}, "pipeline_label must have at least 1"),
    ],
)
def test_out_of_schema_values_refused(registry, cls, doc_patch, message):
    rec = {c: r for r in _records(registry) for c in [type(r)]}[cls]
    doc = {**rec.to_dict(), **doc_patch}
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        cls.from_json(json.dumps(doc))
    with pytest.raises(jsonschema.ValidationError):
        schemas.validate(doc, cls.SCHEMA)


def test_patterns_anchor_at_the_very_end(registry):
    """`$` ends the string (ECMA-262), so a digest with a trailing newline is refused (Python's `re`,
    which the jsonschema package uses, would let `$` match before that newline)."""
    doc = {**_records(registry)[-1].to_dict(), "content_sha256": "0" * 64 + "\n"}
    with pytest.raises(routemm.InvalidArgumentError, match="content_sha256 must match"):
        routemm.PipelineIdentity.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"m": 1', "invalid JSON text"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"m": NaN}', "NaN is not JSON"),
        ('{"m": -Infinity}', "-Infinity is not JSON"),
        ('{"m": 1e999}', "does not fit a double"),
        (b"\xff\xff\xff", "invalid JSON text"),
        ('{"m": ' + "9" * 5000 + "}", "invalid JSON text"),
        (None, "must be str or bytes"),
    ],
    ids=["unterminated", "deep", "nan", "infinity", "huge-float", "not-utf", "huge-int", "none"],
)
def test_malformed_json_text_is_a_routemm_error(text, message):
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.DenseMatmulIdParams.from_json(text)


def test_non_finite_numbers_refused_from_dict():
    doc = routemm.DenseMatmulIdDispatchReceipt(DType.F16, Route.DIRECT, 1).to_dict()
    assert routemm.DenseMatmulIdDispatchReceipt.from_dict(doc).dispatch_count == 1
    import routemm.plans.dense_q4_plan as dq

    dist = dq.DenseQ4TimingDistribution(1.0, 2.0, 3.0, 5).to_dict()
    for bad in (float("nan"), float("inf"), 10**400):
        with pytest.raises(routemm.InvalidArgumentError, match="median_us"):
            dq.DenseQ4TimingDistribution.from_dict({**dist, "median_us": bad})


def test_integral_numbers_are_integers_as_in_json_schema(registry):
    doc = {**routemm.DenseMatmulIdParams(9, 7, 35, 6, 8, 504).to_dict(), "m": 9.0}
    schemas.validate(doc, routemm.DenseMatmulIdParams.SCHEMA)
    back = routemm.DenseMatmulIdParams.from_json(json.dumps(doc))
    assert back.m == 9 and type(back.m) is int
    with pytest.raises(routemm.InvalidArgumentError, match="m must be of type integer"):
        routemm.DenseMatmulIdParams.from_json(json.dumps({**doc, "m": 9.5}))


# ---- fields inherited from generic base records ----------------------------------------------------

A = TypeVar("A")
B = TypeVar("B")


@dataclasses.dataclass(frozen=True)
class _Pair(Generic[A, B]):
    first: A
    rest: tuple[B, ...]
    maybe: Optional[A]


@dataclasses.dataclass(frozen=True)
class _Halfway(_Pair[int, B]):
    """Binds A, hands its own B on under the same name..."""

    label: str


@dataclasses.dataclass(frozen=True)
class _Swapped(_Halfway[A]):
    """...and this one binds it through a variable that means another field in _Pair."""

    other: A


@dataclasses.dataclass(frozen=True)
class _Leaf(_Swapped[Route]):
    pass


def test_inherited_generic_fields_decode_as_their_record_names_them():
    from routemm.core import _json

    doc = {"first": 3.0, "rest": ["direct", "grouped_prefill"], "maybe": None, "label": "x", "other": "direct"}
    leaf = _json._decode_record(_Leaf, doc, "_Leaf")
    assert leaf == _Leaf(3, (Route.DIRECT, Route.GROUPED_PREFILL), None, "x", Route.DIRECT)
    assert type(leaf.first) is int
    with pytest.raises(routemm.InvalidArgumentError, match=r"_Leaf.rest\[0\]: 'sideways' is not a valid"):
        _json._decode_record(_Leaf, {**doc, "rest": ["sideways"]}, "_Leaf")
    with pytest.raises(routemm.InvalidArgumentError, match="_Leaf.maybe must be an integer"):
        _json._decode_record(_Leaf, {**doc, "maybe": "direct"}, "_Leaf")
