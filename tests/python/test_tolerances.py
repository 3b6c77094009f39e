"""The tolerance table itself: never looser than the spec's, and its bound is not vacuous."""

from __future__ import annotations

import numpy as np
from tolerances import SPEC_TOLERANCES, TABLE, accumulation_bound, table_tolerance


def test_tolerance_table_is_tighter_than_spec():
    assert set(TABLE) == set(SPEC_TOLERANCES)
    for dtype, (atol, rtol) in TABLE.items():
        assert atol <= SPEC_TOLERANCES[dtype] and rtol <= SPEC_TOLERANCES[dtype]
        assert table_tolerance(dtype, 32) == (atol, rtol)


def test_accumulation_bound_is_tight_enough_to_fail():
    # K=35, magnitude 35: about 2.3e-5, so an error of 1e-4 (e.g. one dropped tiny term) is caught.
    bound = accumulation_bound(35, np.array([35.0]))[0]
    assert 1e-6 < bound < 5e-5
    # It scales with the data, so huge edge values get a proportionate (not absolute) bound.
    assert accumulation_bound(35, np.array([1e38]))[0] / 1e38 < 1e-6
