"""Compile (or load from numba's on-disk cache) every kernel of the lookup and update paths before serving.

numba compiles a function on its first call, once per argument types (a read-only array, as ``np.frombuffer``
gives for a gRPC request or a Kafka message, is a different type from a writable one). Without a warm-up the first
lookups after a start paid seconds of compilation. Every module that owns compiled kernels exposes one function that
runs each of them on tiny inputs of every type the serving paths pass, and lists it in :data:`WARM_UPS`;
:func:`warm_all` runs them all. ``hps serve`` runs it before gRPC health and ``/readyz`` say SERVING, and the Docker
images run ``python -m hps_service.jit.warmup`` at build time into the ``NUMBA_CACHE_DIR`` they serve with, so a pod
loads machine code instead of compiling it.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: What each kernel-owning module runs to warm its kernels: name -> "module:function" (a function of no arguments).
WARM_UPS: dict[str, str] = {
    "key dedup (keys)": "hps_service.keys:warm_up_kernels",
    "hash map tier": "hps_service.tiers.hashmap.tier:warm_up_kernels",
    "L1 cache, CPU kernels": "hps_service.cache.set_assoc:warm_up_kernels",
    "L1 cache, serving paths": "hps_service.cache.factory:warm_up_table_cache",
    "node store and its readers": "hps_service.node.kernel_warmup:warm_up_kernels",
    "row formats (decoders)": "hps_service.rows.formats:warm_up_kernels",
    "ingest admission sketch": "hps_service.engine.ingest_admission:warm_up_kernels",
}


def read_only(arr: np.ndarray) -> np.ndarray:
    """A read-only copy of ``arr`` (the type numba sees for arrays made with ``np.frombuffer`` on bytes)."""
    out = np.array(arr, copy=True)
    out.flags.writeable = False
    return out


def _resolve(target: str) -> Callable[[], object]:
    module, _, name = target.partition(":")
    warm_up: Callable[[], object] = getattr(importlib.import_module(module), name)
    return warm_up


def warm_all() -> dict[str, float]:
    """Run every warm-up of :data:`WARM_UPS`; returns the seconds each took (compiling, or loading from cache)."""
    took: dict[str, float] = {}
    for name, target in WARM_UPS.items():
        started = time.perf_counter()
        _resolve(target)()
        took[name] = time.perf_counter() - started
    log.info("compiled kernels ready in %.1f s (%s)", sum(took.values()),
             ", ".join(f"{name} {s:.1f} s" for name, s in took.items()))
    return took


def seed_kernel_cache() -> int:
    """Copy the kernels compiled at build time (``HPS_KERNEL_CACHE_SEED``) into ``NUMBA_CACHE_DIR`` where missing;
    returns the files copied. Call before any module with kernels is imported (numba picks a cache directory then)."""
    seed, target = os.environ.get("HPS_KERNEL_CACHE_SEED"), os.environ.get("NUMBA_CACHE_DIR")
    if not seed or not target or not Path(seed).is_dir() or Path(seed).resolve() == Path(target).resolve():
        return 0
    copied = 0
    for src in Path(seed).rglob("*"):
        dest = Path(target) / src.relative_to(seed)
        if src.is_file() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            copied += 1
    return copied


def main() -> int:
    """``python -m hps_service.jit.warmup``: warm every kernel (the Docker build fills NUMBA_CACHE_DIR this way)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    warm_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
