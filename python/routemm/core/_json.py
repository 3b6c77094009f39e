"""JSON for frozen dataclasses: closed documents with a checked schema_version.

A record class is a frozen dataclass that derives from `JsonRecord` and names its schema file. It may
inherit fields from a generic dataclass, naming their types as type arguments (`Base[int, str]`);
decoding reads each inherited field as the type its record class names.
`to_json()` writes sorted keys and refuses NaN/Inf. `from_json()`/`from_dict()` accept exactly what
the shipped schema accepts (checked by `_schemas.check`, the one definition of a record's JSON):
unknown or missing fields, another schema_version, out-of-range numbers, unknown enum strings and
unmatched patterns are refused, and so are NaN, Infinity and malformed or deeply nested text. Every
refusal is an InvalidArgumentError.

An integer field accepts an integral number written as a float (9.0), as JSON Schema does;
`from_dict(..., exact_integers=True)` refuses it instead, for documents this library wrote itself
(saved plans and receipts), which never hold one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any, ClassVar

from .. import _core
from . import _schemas
from ._errors import InvalidArgumentError

_DTYPES = {d.type_name: d for d in _core.DType.__members__.values()}


def dtype_from_name(name: str) -> _core.DType:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r}") from None


class JsonRecord:
    """Mixin for frozen dataclasses that travel as JSON."""

    SCHEMA: ClassVar[str]  # file name under routemm/core/schemas/

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False, **kwargs)

    @classmethod
    def from_dict(cls, data: Any, *, exact_integers: bool = False):
        """The record of a parsed JSON document; with `exact_integers`, an integer field holding a
        float (9.0) is refused rather than read as an integer."""
        _schemas.check(data, cls.SCHEMA, _schemas.record_definition(cls.SCHEMA, cls.__name__), cls.__name__)
        return _decode(cls, data, cls.__name__, exact_integers)

    @classmethod
    def from_json(cls, text: str | bytes):
        return cls.from_dict(_schemas.parse(text, cls.__name__))


def _encode(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, _core.DType):
        return value.type_name
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(tp: Any, data: Any, where: str, exact: bool = False) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], data, where, exact)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise InvalidArgumentError(f"{where} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]", exact) for i, v in enumerate(data))
        if len(args) != len(data):
            raise InvalidArgumentError(f"{where} must have {len(args)} items")
        return tuple(_decode(a, v, f"{where}[{i}]", exact) for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{where} must be an object")
        return {_decode(key_t, k, where, exact): _decode(val_t, v, f"{where}.{k}", exact) for k, v in data.items()}
    if isinstance(tp, type) and issubclass(tp, JsonRecord):
        return _decode_record(tp, data, where, exact)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise InvalidArgumentError(f"{where}: {data!r} is not a valid {tp.__name__}") from None
    if tp is _core.DType:
        if not isinstance(data, str):
            raise InvalidArgumentError(f"{where} must be a dtype name")
        return dtype_from_name(data)
    if tp is bool:
        if not isinstance(data, bool):
            raise InvalidArgumentError(f"{where} must be a boolean")
        return data
    if tp is int:
        if isinstance(data, float) and data.is_integer():  # JSON Schema's integers include 1.0
            if exact:
                raise InvalidArgumentError(f"{where} must be written as an integer, got {data!r}")
            return int(data)
        if isinstance(data, bool) or not isinstance(data, int):
            raise InvalidArgumentError(f"{where} must be an integer")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise InvalidArgumentError(f"{where} must be a number")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise InvalidArgumentError(f"{where} must be a string")
        return data
    if tp is Any:
        return data
    raise TypeError(f"no JSON decoding for {tp!r}")


@functools.lru_cache(maxsize=None)
def _record_layout(cls: type) -> tuple[dict, dict]:
    """(field types, fields by name) of a record class; resolving hints is slow, so once per class.
    A field declared by a generic base record (`class R(Base[int, str])`) has the type the
    subclass names for it."""
    bindings = _type_bindings(cls)
    types: dict = {}
    for klass in reversed(cls.__mro__):  # bases first: a redeclared field takes its subclass's type
        own = klass.__dict__.get("__annotations__", {})
        if own:
            hints = typing.get_type_hints(klass)
            types.update({name: _substitute(hints[name], bindings.get(klass, {})) for name in own})
    return types, {f.name: f for f in dataclasses.fields(cls)}


def _type_bindings(cls: type) -> dict:
    """{generic base: {its type variable: the type `cls` gives it}} over all of cls's ancestors. A
    class precedes its bases in the MRO, so its own bindings are known when its bases' are made."""
    bindings: dict = {}
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            origin = typing.get_origin(base)
            variables = getattr(origin, "__parameters__", ())
            if variables:  # not Generic[...] itself, which only declares variables
                values = [_substitute(a, bindings.get(klass, {})) for a in typing.get_args(base)]
                bindings[origin] = dict(zip(variables, values, strict=True))
    return bindings


def _substitute(tp: Any, binding: dict) -> Any:
    """`tp` with its type variables replaced as `binding` says (`tuple[T, ...]` -> `tuple[int, ...]`)."""
    if isinstance(tp, typing.TypeVar):
        return binding.get(tp, tp)
    variables = getattr(tp, "__parameters__", ()) if typing.get_origin(tp) is not None else ()
    return tp[tuple(binding.get(v, v) for v in variables)] if variables else tp


def _decode_record(cls: type, data: Any, where: str, exact: bool = False) -> Any:
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{where} must be a JSON object")
    hints, fields = _record_layout(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown field(s) {', '.join(unknown)}")
    missing = sorted(set(fields) - set(data))
    if missing:
        raise InvalidArgumentError(f"{where}: missing field(s) {', '.join(missing)}")
    if "schema_version" in fields:
        expected = fields["schema_version"].default
        if data["schema_version"] != expected:
            raise InvalidArgumentError(f"{where}: schema_version {data['schema_version']!r} is not {expected}")
    values = {name: _decode(hints[name], data[name], f"{where}.{name}", exact) for name in fields}
    return cls(**values)
