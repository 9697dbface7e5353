"""Read-only views for the arrays a kernel only reads, so that numba compiles one specialisation per kernel.

numba types a read-only array (``np.frombuffer`` on a request's bytes, a worker's mapping of the shared store)
apart from a writable one and compiles a kernel once for each mix it is called with. A kernel's Python wrapper passes
``read_only_view(arr)`` for the arguments the kernel does not write: every call then has the read-only types, one
compile instead of two or four on a cold cache, at the cost of a view (about 0.2 us) where the array was writable.
"""

from __future__ import annotations

import numpy as np


def read_only_view(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when it is read-only, else a read-only view of it (the same memory)."""
    if not arr.flags.writeable:
        return arr
    view = arr.view()
    view.flags.writeable = False
    return view
