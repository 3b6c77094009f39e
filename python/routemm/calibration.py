"""routemm.calibration, the route-calibration engine: the module lives in routemm/plans/calibration.py."""

import sys

from .plans import calibration as _module

sys.modules[__name__] = _module  # this path and the layer's name one module
