"""31-bit access stamps of a 64-bit tick, read back as an age: written once and compiled for each caller (NumPy, numba
on the CPU, numba CUDA device code), so the L1 cache's clocks and the hash map's stamps agree on what is recent.

A stamp keeps the tick's low 31 bits (four bytes a slot instead of eight). Its age at tick ``now`` is the distance
modulo 2**31, taken as signed: up to 2**30 ticks back is that old, a stamp up to 2**30 ticks *ahead* (a reader in
another thread or process drew a later tick than the one ``now`` was read at) is just touched. An access older
than 2**30 ticks reads as recent, which only blurs an eviction order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher

#: The tick bits a stamp keeps; half their range and the whole of it.
MASK, HALF, SPAN = 0x7FFFFFFF, 1 << 30, 1 << 31


def signed_age(now: Any, stamp: Any) -> Any:
    """Ticks since ``stamp`` at tick ``now`` (negative for a stamp drawn later than ``now``), element-wise for NumPy
    arrays; the body of :func:`age` and of the CUDA kernels' device function."""
    age = (now - stamp) & MASK
    return age - (age >= HALF) * SPAN


#: :func:`signed_age` compiled for one int64 tick and stamp, inlined into the numba kernels.
age: Dispatcher[Callable[[np.int64, np.int64], np.int64]] = numba.njit(cache=True, nogil=True,
                                                                     inline="always")(signed_age)
