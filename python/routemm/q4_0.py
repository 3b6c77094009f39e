"""routemm.q4_0, the GGML Q4_0 blocks: the module lives in routemm/formats/q4_0.py."""

import sys

from .formats import q4_0 as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
