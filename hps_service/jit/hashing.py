"""The splitmix64 finalizer, compiled, for the numba kernels that spread keys over slots, sets or blocks."""

from __future__ import annotations

import numba
import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


@numba.njit(cache=True, nogil=True, inline="always")
def mix64(key: np.uint64) -> np.uint64:
    """Every bit of ``key`` spread over every bit of the result (a bijection on 64-bit integers)."""
    x = key
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)
