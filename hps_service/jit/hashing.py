"""How keys are hashed: the splitmix64 finalizer, written once and compiled for each caller (NumPy, numba on the CPU,
numba CUDA device code), and the linear-probing arithmetic of the open-addressing indexes that hash with it (the
hash map tier's, ``tiers/hashmap/index``, and the trainer's ``KeyIndex``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher
from numpy.typing import NDArray

#: What the finalizer mixes: an array of uint64 (NumPy) or one uint64 (the numba and CUDA callers).
U64 = TypeVar("U64", NDArray[np.uint64], np.uint64)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def mix64_array(x: U64) -> U64:
    """The splitmix64 finalizer of uint64 values, element-wise with wrapping arithmetic (NumPy).

    This body is also the source of :func:`mix64` and of the CUDA kernels' device function, so every path spreads
    keys identically: every bit of the input over every bit of the result (a bijection on 64-bit integers).
    """
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


#: :func:`mix64_array` compiled for one uint64, inlined into the numba kernels that spread keys over slots or sets.
mix64: Dispatcher[Callable[[np.uint64], np.uint64]] = numba.njit(cache=True, nogil=True, inline="always")(mix64_array)


@numba.njit(cache=True, nogil=True, inline="always")
def home_slot(key: np.int64, mask: np.int64) -> np.int64:
    """The first slot to probe for ``key`` in a power-of-two table of ``mask + 1`` slots."""
    return np.int64(mix64(np.uint64(key)) & np.uint64(mask))


@numba.njit(cache=True, nogil=True, inline="always")
def stays_in_run(hole: np.int64, home: np.int64, j: np.int64) -> np.bool_:
    """Backward-shift deletion: whether the entry at slot ``j``, whose home slot is ``home``, stays where it is when
    slot ``hole`` (earlier in the same probe run, cyclically) is emptied; if not, it moves into the hole."""
    if hole <= j:
        return hole < home <= j
    return home > hole or home <= j
