"""The JSON Schemas (draft 2020-12) shipped with routemm, and validation against them.

Validation needs the `jsonschema` package (a test extra); loading the schema files does not.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    """The schema document `name` (e.g. 'dense_matmul_id_capability.schema.json')."""
    return json.loads(resources.files("routemm").joinpath("schemas", name).read_text())


def names() -> list[str]:
    return sorted(
        p.name for p in resources.files("routemm").joinpath("schemas").iterdir() if p.name.endswith(".schema.json")
    )


@functools.lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema

    schema = load(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def validate(record: Any, name: str | None = None) -> None:
    """Validate a record (a JsonRecord or a plain dict) against its schema; raises on failure."""
    import jsonschema

    if name is None:
        name = type(record).SCHEMA
    doc = record.to_dict() if hasattr(record, "to_dict") else record
    errors = sorted(_validator(name).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        raise jsonschema.ValidationError(f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors))
