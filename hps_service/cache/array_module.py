"""Choose the array module (NumPy or CuPy) the L1 cache runs on, from ``cache.backend``.

The cache code is written once against ``xp``; this module decides which ``xp`` it gets and moves
arrays between it and the host.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np

from hps_service.errors import InvalidArgumentError, UnavailableError

BACKENDS = ("auto", "numpy", "cupy")


def _import_cupy() -> ModuleType | None:
    try:
        return importlib.import_module("cupy")
    except Exception:  # noqa: BLE001 - a broken CUDA install raises more than ImportError
        return None


def cupy_usable() -> bool:
    """True when CuPy imports and a CUDA device answers a trivial kernel."""
    cp = _import_cupy()
    if cp is None:
        return False
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return False
        return int(cp.arange(3, dtype=cp.int64).sum()) == 3
    except Exception:  # noqa: BLE001 - no driver, no device, or a device in a bad state
        return False


def get_array_module(backend: str) -> ModuleType:
    """The module for ``backend``: auto (CuPy when a CUDA device is usable, else NumPy), numpy or cupy."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"cache.backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "numpy":
        return np
    if cupy_usable():
        return _import_cupy()  # type: ignore[return-value]
    if backend == "cupy":
        raise UnavailableError(
            "cache.backend is 'cupy' but no usable CUDA device was found (is cupy-cuda12x installed "
            "and a GPU visible?); use backend 'auto' or 'numpy' to run the cache in host memory"
        )
    return np


def is_numpy(xp: ModuleType) -> bool:
    """True when ``xp`` is NumPy (the compiled CPU fast path applies)."""
    return xp is np


def to_host(arr: Any) -> np.ndarray:
    """A NumPy view or copy of an array of either module."""
    if isinstance(arr, np.ndarray):
        return arr
    return arr.get()
