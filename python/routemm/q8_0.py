"""routemm.q8_0, the GGML Q8_0 blocks: the module lives in routemm/formats/q8_0.py."""

import sys

from .formats import q8_0 as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
