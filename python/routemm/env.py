"""routemm.env, the environment knobs: the module lives in routemm/core/env.py."""

import sys

from .core import env as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
