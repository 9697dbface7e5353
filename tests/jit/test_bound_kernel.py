"""A numba kernel bound to its leading arguments answers as the dispatcher's call does, for each bound overload."""

from __future__ import annotations

import numba
import numpy as np

from hps_service.jit.bound import bind_kernel


@numba.njit(cache=False)
def _scaled_sum(table, scale, keys, out):
    total = 0
    for i in range(keys.shape[0]):
        out[i] = table[keys[i]] * scale
        total += keys[i]
    return total


def test_the_bound_call_answers_as_the_dispatched_call() -> None:
    table = np.arange(100, dtype=np.float32) * 0.5
    keys = np.array([3, 99, 0, 3], np.int64)
    bound = bind_kernel(_scaled_sum, (table, 2.0), (np.empty(0, np.int64), np.empty(0, np.float32)))
    got, want = np.empty(4, np.float32), np.empty(4, np.float32)
    assert bound(keys, got) == _scaled_sum(table, 2.0, keys, want) == 105
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [3.0, 99.0, 0.0, 3.0])


def test_each_binding_keeps_its_own_fixed_arguments_and_overload() -> None:
    halves = bind_kernel(_scaled_sum, (np.arange(10, dtype=np.float64), 0.5),
                         (np.empty(0, np.int64), np.empty(0, np.float64)))
    triples = bind_kernel(_scaled_sum, (np.arange(10, dtype=np.float32), 3.0),
                          (np.empty(0, np.int64), np.empty(0, np.float32)))
    a, b = np.empty(2, np.float64), np.empty(2, np.float32)
    halves(np.array([4, 9], np.int64), a)
    triples(np.array([4, 9], np.int64), b)
    np.testing.assert_array_equal(a, [2.0, 4.5])
    np.testing.assert_array_equal(b, [12.0, 27.0])
