"""Key batch helpers: validation and the compiled deduplication the hot paths use instead of np.unique."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hps_service.errors import InvalidArgumentError, ResourceExhaustedError
from hps_service.keys import as_keys, distinct_with_inverse, unique_with_inverse

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
batches = st.one_of(st.lists(st.integers(-8, 8), max_size=64), st.lists(int64s, max_size=64))


@settings(deadline=None)
@given(batches)
def test_unique_with_inverse_equals_numpy(keys: list[int]) -> None:
    arr = np.array(keys, dtype=np.int64)
    uniq, inverse = unique_with_inverse(arr)
    expected_uniq, expected_inverse = np.unique(arr, return_inverse=True)
    assert np.array_equal(uniq, expected_uniq)
    assert np.array_equal(inverse, expected_inverse)
    assert np.array_equal(uniq[inverse], arr)


@settings(deadline=None)
@given(batches)
def test_distinct_with_inverse_keeps_first_appearances(keys: list[int]) -> None:
    arr = np.array(keys, dtype=np.int64)
    uniq, inverse = distinct_with_inverse(arr)
    first = sorted(np.unique(arr, return_index=True)[1])
    assert np.array_equal(uniq, arr[first])
    assert np.array_equal(uniq[inverse], arr)


def test_as_keys_validates() -> None:
    assert as_keys([3, 1]).dtype == np.int64
    with pytest.raises(InvalidArgumentError):
        as_keys(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(InvalidArgumentError):
        as_keys(np.array([1.5]))
    with pytest.raises(InvalidArgumentError):
        as_keys(np.array([2**63], dtype=np.uint64))
    with pytest.raises(ResourceExhaustedError):
        as_keys(np.arange(5), max_keys=4)
