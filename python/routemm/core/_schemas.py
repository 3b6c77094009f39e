"""The JSON Schemas (draft 2020-12) shipped with routemm, and validation against them.

The shipped schemas are the one definition of what a record's JSON may hold: `check` reads them and
enforces the subset of JSON Schema they use (type, const, enum, properties, required,
additionalProperties, items, prefixItems, minItems/maxItems, minLength/maxLength, pattern,
minimum/maximum, allOf/anyOf/oneOf/not, if/then/else, $ref into $defs), with no dependency beyond
the standard library; every `from_json`/`from_dict` goes through it. A schema that uses any other
keyword is refused when it is first compiled, so the subset cannot silently drift.

Two readings are deliberate and the same as the draft's intent rather than a particular library's:
`pattern` is matched with ECMA-262 anchors (`$` matches only at the very end, not before a final
newline), and a JSON number (a float field) must be a finite double. `validate` (public as
`routemm.schemas.validate`) runs the full `jsonschema` package instead, an optional dependency (the
`schemas` extra); the tests cross-check the two on mutated documents.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from importlib import resources
from typing import Any, Callable, Optional

from ._errors import InvalidArgumentError, MissingDependencyError


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    """The schema document `name` (e.g. 'dense_matmul_id_capability.schema.json')."""
    return json.loads(resources.files("routemm.core").joinpath("schemas", name).read_text())


def names() -> list[str]:
    return sorted(
        p.name for p in resources.files("routemm.core").joinpath("schemas").iterdir() if p.name.endswith(".schema.json")
    )


JSONSCHEMA_HINT = 'pip install "routemm[schemas]" (or: pip install "jsonschema>=4.18")'


def _jsonschema():
    try:
        import jsonschema
    except ImportError as e:
        raise MissingDependencyError(
            f"routemm.schemas.validate needs the jsonschema package, which is not installed: {JSONSCHEMA_HINT}. "
            "Loading records with from_json/from_dict needs no extra package."
        ) from e
    return jsonschema


@functools.lru_cache(maxsize=None)
def _name_set() -> frozenset:
    return frozenset(names())


@functools.lru_cache(maxsize=None)
def _validator(name: str, definition: Optional[str]):
    jsonschema = _jsonschema()
    root = load(name)
    jsonschema.Draft202012Validator.check_schema(root)
    # A record described by a `$defs` entry is checked against that entry, its references resolving
    # in the same file.
    schema = root if definition is None else {**root["$defs"][definition], "$defs": root["$defs"]}
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def validate(record: Any, name: str | None = None) -> None:
    """Validate a record (a JsonRecord) or a parsed JSON document (then `name` is required) against
    its shipped schema with the `jsonschema` package; raises jsonschema.ValidationError listing every
    violation, MissingDependencyError without the package, InvalidArgumentError for an unknown
    schema name or a document without one."""
    jsonschema = _jsonschema()
    is_record = hasattr(record, "to_dict") and hasattr(type(record), "SCHEMA")
    if name is None:
        if not is_record:
            raise InvalidArgumentError(
                f"validate: a plain {type(record).__name__} needs the schema name (one of {', '.join(names())})"
            )
        name = type(record).SCHEMA
    if name not in _name_set():
        raise InvalidArgumentError(f"validate: no schema {name!r}; routemm ships {', '.join(names())}")
    definition = None
    if is_record and name == type(record).SCHEMA:
        definition = record_definition(name, type(record).__name__)
    doc = record.to_dict() if is_record else record
    errors = sorted(_validator(name, definition).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        raise jsonschema.ValidationError(f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors))


# ---- The built-in checker ------------------------------------------------------------------------

# A compiled schema node: check(value, path) -> None when valid, else a message naming the path.
_Check = Callable[[Any, str], Optional[str]]

_IGNORED = {"$schema", "$id", "$defs", "title", "description"}


def check(document: Any, name: str, definition: Optional[str] = None, where: str = "") -> None:
    """Raise InvalidArgumentError unless `document` (parsed JSON) conforms to the schema file `name`
    (or to its `$defs/<definition>`). `where` prefixes the message (e.g. the record class)."""
    problem = _compiled(name, definition)(document, "")
    if problem is not None:
        raise InvalidArgumentError(f"{where or definition or name}: {problem}")


def record_definition(name: str, class_name: str) -> Optional[str]:
    """Which part of schema file `name` describes the record class `class_name`: None for the whole
    document (its title is the class name), else the `$defs` entry of that name."""
    schema = load(name)
    if schema.get("title") == class_name:
        return None
    if class_name in schema.get("$defs", {}):
        return class_name
    raise LookupError(f"schema {name} describes no record {class_name}")


@functools.lru_cache(maxsize=None)
def _compiled(name: str, definition: Optional[str]) -> _Check:
    root = load(name)
    refs: dict[str, _Check] = {}
    node = root if definition is None else root["$defs"][definition]
    return _compile(node, root, refs, name)


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value (1 == 1.0), booleans distinct from numbers, deep for
    arrays and objects."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "number": _is_number,
    # JSON Schema: an integer is any number with no fractional part (1.0 included).
    "integer": lambda v: _is_number(v) and (isinstance(v, int) or (math.isfinite(v) and v.is_integer())),
}


def _ecma_pattern(pattern: str) -> re.Pattern:
    # An unescaped final `$` anchors at the very end (ECMA-262), not before a trailing newline.
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.compile(pattern)


def _compile(node: Any, root: dict, refs: dict, name: str) -> _Check:
    if node is True:
        return lambda v, p: None
    if node is False:
        return lambda v, p: f"{_at(p)} is not allowed"
    unknown = set(node) - _IGNORED - _KEYWORDS
    if unknown:
        raise LookupError(f"schema {name} uses keywords the built-in checker lacks: {sorted(unknown)}")
    checks = [_KEYWORDS_COMPILE[k](node, root, refs, name) for k in _KEYWORD_ORDER if k in node]
    checks = [c for c in checks if c is not None]

    def run(value, path):
        for c in checks:
            problem = c(value, path)
            if problem is not None:
                return problem
        return None

    return run


def _at(path: str) -> str:
    return path or "the document"


def _in(path: str) -> str:
    return f" in {path}" if path else ""


def _c_type(node, root, refs, name):
    kinds = node["type"] if isinstance(node["type"], list) else [node["type"]]
    tests = [_TYPES[k] for k in kinds]
    finite_numbers = "number" in kinds

    def run(v, p):
        if not any(t(v) for t in tests):
            return f"{_at(p)} must be of type {' or '.join(kinds)}, got {type(v).__name__}"
        if finite_numbers and isinstance(v, float) and not math.isfinite(v):
            return f"{_at(p)} must be a finite number, got {v!r}"
        if finite_numbers and isinstance(v, int) and not isinstance(v, bool) and abs(v) > _DOUBLE_MAX:
            return f"{_at(p)} is beyond the range of a double"
        return None

    return run


_DOUBLE_MAX = int(sys.float_info.max)


def _c_const(node, root, refs, name):
    want = node["const"]
    return lambda v, p: None if _json_equal(v, want) else f"{_at(p)} must be {want!r}, got {_short(v)}"


def _c_enum(node, root, refs, name):
    options = node["enum"]

    def run(v, p):
        if any(_json_equal(v, o) for o in options):
            return None
        return f"{_at(p)} must be one of {', '.join(map(repr, options))}, got {_short(v)}"

    return run


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _c_minimum(node, root, refs, name):
    low = node["minimum"]
    return lambda v, p: f"{_at(p)} must be >= {low}, got {_short(v)}" if _is_number(v) and v < low else None


def _c_maximum(node, root, refs, name):
    high = node["maximum"]
    return lambda v, p: f"{_at(p)} must be <= {high}, got {_short(v)}" if _is_number(v) and v > high else None


def _c_min_length(node, root, refs, name):
    n = node["minLength"]
    return lambda v, p: f"{_at(p)} must have at least {n} characters" if isinstance(v, str) and len(v) < n else None


def _c_max_length(node, root, refs, name):
    n = node["maxLength"]
    return lambda v, p: f"{_at(p)} must have at most {n} characters" if isinstance(v, str) and len(v) > n else None


def _c_pattern(node, root, refs, name):
    rx = _ecma_pattern(node["pattern"])

    def run(v, p):
        if isinstance(v, str) and rx.search(v) is None:
            return f"{_at(p)} must match {node['pattern']}, got {_short(v)}"
        return None

    return run


def _c_min_items(node, root, refs, name):
    n = node["minItems"]
    return lambda v, p: f"{_at(p)} must have at least {n} items" if isinstance(v, list) and len(v) < n else None


def _c_max_items(node, root, refs, name):
    n = node["maxItems"]
    return lambda v, p: f"{_at(p)} must have at most {n} items" if isinstance(v, list) and len(v) > n else None


def _c_prefix_items(node, root, refs, name):
    subs = [_compile(s, root, refs, name) for s in node["prefixItems"]]

    def run(v, p):
        if isinstance(v, list):
            for i, (item, sub) in enumerate(zip(v, subs, strict=False)):  # a shorter array is fine
                problem = sub(item, f"{p}[{i}]")
                if problem is not None:
                    return problem
        return None

    return run


def _c_items(node, root, refs, name):
    start = len(node.get("prefixItems", ()))
    sub = _compile(node["items"], root, refs, name)

    def run(v, p):
        if isinstance(v, list):
            for i in range(start, len(v)):
                problem = sub(v[i], f"{p}[{i}]")
                if problem is not None:
                    return problem
        return None

    return run


def _c_required(node, root, refs, name):
    keys = node["required"]

    def run(v, p):
        if isinstance(v, dict):
            missing = [k for k in keys if k not in v]
            if missing:
                return f"missing field(s) {', '.join(missing)}{_in(p)}"
        return None

    return run


def _c_properties(node, root, refs, name):
    subs = {k: _compile(s, root, refs, name) for k, s in node["properties"].items()}

    def run(v, p):
        if isinstance(v, dict):
            for k, sub in subs.items():
                if k in v:
                    problem = sub(v[k], f"{p}.{k}" if p else k)
                    if problem is not None:
                        return problem
        return None

    return run


def _c_additional(node, root, refs, name):
    known = set(node.get("properties", {}))
    sub = _compile(node["additionalProperties"], root, refs, name)

    def run(v, p):
        if isinstance(v, dict):
            for k in sorted(set(v) - known, key=str):
                if node["additionalProperties"] is False:
                    return f"unknown field(s) {', '.join(sorted(map(str, set(v) - known)))}{_in(p)}"
                problem = sub(v[k], f"{p}.{k}" if p else str(k))
                if problem is not None:
                    return problem
        return None

    return run


def _c_ref(node, root, refs, name):
    ref = node["$ref"]
    if not ref.startswith("#/$defs/"):
        raise LookupError(f"schema {name}: only local $defs references are supported, got {ref}")
    key = ref[len("#/$defs/") :]

    def run(v, p):
        if key not in refs:  # compiled on first use, so recursive definitions terminate
            refs[key] = _compile(root["$defs"][key], root, refs, name)
        return refs[key](v, p)

    return run


def _c_all_of(node, root, refs, name):
    subs = [_compile(s, root, refs, name) for s in node["allOf"]]

    def run(v, p):
        for sub in subs:
            problem = sub(v, p)
            if problem is not None:
                return problem
        return None

    return run


def _c_any_of(node, root, refs, name):
    subs = [_compile(s, root, refs, name) for s in node["anyOf"]]

    def run(v, p):
        problems = [sub(v, p) for sub in subs]
        return None if any(x is None for x in problems) else _closest(problems)

    return run


def _closest(problems: list) -> str:
    """The problem of the alternative that came nearest: one past its type check, where there is one."""
    return next((x for x in problems if "must be of type" not in x), problems[0])


def _c_one_of(node, root, refs, name):
    subs = [_compile(s, root, refs, name) for s in node["oneOf"]]

    def run(v, p):
        problems = [sub(v, p) for sub in subs]
        matched = sum(x is None for x in problems)
        if matched == 1:
            return None
        return _closest(problems) if not matched else f"{_at(p)} matches {matched} of its exclusive forms"

    return run


def _c_not(node, root, refs, name):
    sub = _compile(node["not"], root, refs, name)
    return lambda v, p: f"{_at(p)} has a value that is not allowed: {_short(v)}" if sub(v, p) is None else None


def _c_if(node, root, refs, name):
    cond = _compile(node["if"], root, refs, name)
    then = _compile(node.get("then", True), root, refs, name)
    other = _compile(node.get("else", True), root, refs, name)
    return lambda v, p: then(v, p) if cond(v, p) is None else other(v, p)


_KEYWORDS_COMPILE = {
    "type": _c_type,
    "const": _c_const,
    "enum": _c_enum,
    "minimum": _c_minimum,
    "maximum": _c_maximum,
    "minLength": _c_min_length,
    "maxLength": _c_max_length,
    "pattern": _c_pattern,
    "minItems": _c_min_items,
    "maxItems": _c_max_items,
    "prefixItems": _c_prefix_items,
    "items": _c_items,
    "required": _c_required,
    "properties": _c_properties,
    "additionalProperties": _c_additional,
    "$ref": _c_ref,
    "allOf": _c_all_of,
    "anyOf": _c_any_of,
    "oneOf": _c_one_of,
    "not": _c_not,
    "if": _c_if,
    "then": lambda *a: None,  # compiled with "if"
    "else": lambda *a: None,
}
_KEYWORDS = set(_KEYWORDS_COMPILE)
# The order checks run in (the first problem is reported): the type first, then the value's own
# constraints, then the combinators that refine them.
_KEYWORD_ORDER = list(_KEYWORDS_COMPILE)


# ---- Strict JSON text --------------------------------------------------------------------------


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} does not fit a double")
    return value


def parse(text: Any, where: str) -> Any:
    """Parse JSON text strictly: NaN, Infinity and numbers beyond a double are refused; malformed,
    undecodable or too deeply nested text is an InvalidArgumentError naming `where`."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise InvalidArgumentError(f"{where}: JSON text must be str or bytes, got {type(text).__name__}")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidArgumentError(f"{where}: JSON text is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the integer digit limit
        raise InvalidArgumentError(f"{where}: invalid JSON text: {e}") from None
