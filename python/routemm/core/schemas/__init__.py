"""The JSON Schemas (draft 2020-12) of routemm's records, and validation against them.

Every record class (a frozen dataclass with `to_json` / `from_json`) names its schema file in
`SCHEMA`; the files ship in this package. `validate(record)` checks a record, or
`validate(document, name)` a parsed JSON document, with the `jsonschema` package, an optional
dependency: `pip install "routemm[schemas]"`. Without it `validate` raises
routemm.MissingDependencyError saying so. Loading records needs no extra package: `from_json` and
`from_dict` accept exactly what these schemas accept, through a built-in checker.
"""

from .._schemas import load, names, validate

__all__ = ["load", "names", "validate"]
