"""routemm.schemas, the records' JSON Schemas: the module lives in routemm/core/schemas/."""

import sys

from .core import schemas as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
