"""routemm.dense_matmul_id, the expert-ID matmul: the module lives in routemm/ops/dense_matmul_id.py."""

import sys

from .ops import dense_matmul_id as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
