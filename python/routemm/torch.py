"""`import routemm.torch` registers torch.ops.routemm.*: the module lives in routemm/integrations/torch.py."""

import sys

from .integrations import torch as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
