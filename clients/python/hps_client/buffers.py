"""The check every caller-owned row buffer passes before compiled code writes rows into it (no gRPC here: the
server's caches use it too)."""

from __future__ import annotations

import numpy as np

from hps_client.errors import InvalidArgumentError

_FLOAT32 = np.dtype(np.float32)


def check_out(out: np.ndarray, n: int, dim: int) -> np.ndarray:
    """``out`` if it can take the rows of ``n`` keys of ``dim`` (a writable C-contiguous float32 ``(n, dim)``
    array), else InvalidArgumentError saying what it is."""
    if type(out) is np.ndarray and out.dtype is _FLOAT32 and out.shape == (n, dim):
        flags = out.flags  # a new object at each access
        if flags.c_contiguous and flags.writeable:
            return out  # the usual buffer, checked in a third of the time the general test below takes
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n, dim)
            or not out.flags.c_contiguous or not out.flags.writeable):
        got = (f"{out.dtype} {out.shape}" + ("" if out.flags.c_contiguous else ", not C-contiguous")
               + ("" if out.flags.writeable else ", read-only")) if isinstance(out, np.ndarray) else type(out).__name__
        raise InvalidArgumentError(
            f"out must be a writable C-contiguous float32 array of shape ({n}, {dim}), got {got}")
    return out
