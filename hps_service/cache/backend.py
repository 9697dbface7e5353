"""Choose where the L1 cache lives from ``cache.backend``: host memory (NumPy) or a CUDA device.

``numpy`` is host memory. ``cupy`` is the CUDA device cache (numba-cuda kernels on CuPy-compatible device
arrays, from the ``gpu`` extra) and fails at start when no device is usable. ``auto`` takes the device
when one is usable, else host memory, and logs which it chose and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Literal

from hps_service.errors import InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "numpy", "cupy")
Resolved = Literal["numpy", "cuda"]


def _driver_present() -> bool:
    """Whether the CUDA driver library loads (no driver: no device, whatever is installed)."""
    for name in ("libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


@functools.cache
def device_status() -> tuple[bool, str]:
    """(usable, why): whether numba-cuda imports and a CUDA device answers, with the device's name or the reason."""
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    if not simulated and not _driver_present():
        # Checked first: importing numba.cuda takes seconds, which every start on a CPU machine would pay.
        return False, "no CUDA driver on this machine (libcuda not found)"
    try:
        from numba import cuda
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install raises more than ImportError
        return False, f"numba.cuda does not import ({exc}); install the gpu extra: pip install 'hps-service[gpu]'"
    if simulated:
        return True, "the numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1: device kernels run on the CPU, slowly)"
    try:
        if not cuda.is_available():
            return False, "no CUDA driver or device is visible to numba.cuda"
        device = cuda.get_current_device()
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        return True, f"CUDA device {device.id}: {name}"
    except Exception as exc:  # noqa: BLE001 - no driver, no device, or a device in a bad state
        return False, f"the CUDA device is not usable ({type(exc).__name__}: {exc})"


def resolve_backend(backend: str) -> Resolved:
    """``numpy`` or ``cuda`` for a ``cache.backend`` setting; ``auto`` logs its choice and the reason."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"cache.backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "numpy":
        return "numpy"
    usable, why = device_status()
    if backend == "cupy":
        if not usable:
            raise UnavailableError(
                f"cache.backend is 'cupy' but no usable CUDA device was found: {why}; use backend 'auto' or "
                "'numpy' to run the cache in host memory")
        log.info("L1 cache backend: the CUDA device cache (configured 'cupy'), on %s", why)
        return "cuda"
    if usable:
        log.info("L1 cache backend 'auto' chose the CUDA device cache: %s", why)
        return "cuda"
    log.info("L1 cache backend 'auto' chose host memory (NumPy): %s", why)
    return "numpy"
