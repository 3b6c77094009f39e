"""Checks that every record dataclass runs when it is constructed (JSON decoding builds records
through their constructors too, so both paths refuse the same things)."""

from __future__ import annotations

import dataclasses

from ._errors import InvalidArgumentError


class SchemaVersioned:
    """Mixin for frozen record dataclasses with a `schema_version` field: a record can only be built
    at the version its class writes (the field's default), so no record claims a schema it does not
    follow. Subclasses with their own __post_init__ call super().__post_init__()."""

    def __post_init__(self) -> None:
        expected = {f.name: f for f in dataclasses.fields(self)}["schema_version"].default
        version = self.schema_version
        if isinstance(version, bool) or version != expected:
            raise InvalidArgumentError(f"{type(self).__name__}: schema_version {version!r} is not {expected}")
