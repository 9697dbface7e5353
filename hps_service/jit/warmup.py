"""Compile (or load from numba's on-disk cache) every kernel of the lookup and update paths before serving.

numba compiles a function on its first call, once per argument types (a read-only array, as ``np.frombuffer``
gives for a gRPC request or a Kafka message, is a different type from a writable one: the wrappers pass read-only
views, see :mod:`hps_service.jit.views`). Without a warm-up the first lookups after a start paid seconds of
compilation. Every module that owns compiled kernels exposes one function that runs each of them on tiny inputs of
every type the serving paths pass, and lists it in :data:`WARM_UPS`; :func:`warm_all` runs them all, saying what it
does: on a cold cache a line when compiling begins, one every few seconds while it lasts, and the true total.
``make install`` (and so ``make run``) and the Docker images run ``python -m hps_service.jit.warmup`` when they
install, so ``hps serve`` loads machine code instead of compiling it; ``hps serve`` runs it before anything else
reads the kernels (the fork server of its workers included), before gRPC health and ``/readyz`` say SERVING.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numba.core import event

log = logging.getLogger(__name__)

#: What each kernel-owning module runs to warm its kernels: name -> "module:function" (a function of no arguments).
WARM_UPS: dict[str, str] = {
    "key dedup (keys)": "hps_service.keys:warm_up_kernels",
    "hash map tier": "hps_service.tiers.hashmap.warmup:warm_up_kernels",
    "L1 cache, CPU kernels": "hps_service.cache.set_assoc:warm_up_kernels",
    "L1 cache, serving paths": "hps_service.cache.factory:warm_up_table_cache",
    "node store and its readers": "hps_service.node.kernel_warmup:warm_up_kernels",
    "row formats (decoders)": "hps_service.rows.formats:warm_up_kernels",
    "ingest admission sketch": "hps_service.engine.ingest_admission:warm_up_kernels",
    "pooled lookups (bags)": "hps_service.engine.bags:warm_up_kernels",
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


#: The cold compile of every warm-up, in seconds, on an idle 2-core x86-64 machine (the reference of the
#: benchmarks): what the first line of a cold warm-up announces.
COLD_COMPILE_S = 15
#: While compiling, a progress line this often (no silent gap in a first start's log).
PROGRESS_EVERY_S = 5.0


class _Compiles(event.Listener):
    """Counts numba's compiles (its ``numba:compile`` event fires only on a cache miss) and notes when the first
    began."""

    def __init__(self) -> None:
        self.count = 0
        self.first = threading.Event()

    def on_start(self, ev: event.Event) -> None:
        self.count += 1
        self.first.set()

    def on_end(self, ev: event.Event) -> None:
        pass


class _Progress:
    """The lines a warm-up logs while it compiles: one when the first compile begins, then one every
    :data:`PROGRESS_EVERY_S` naming the warm-up under way."""

    def __init__(self, compiles: _Compiles, when: str) -> None:
        self.compiles = compiles
        self.when = when
        self.current = ""
        self.started = time.perf_counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hps-kernel-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.compiles.first.wait(0.05):
            if self._done.is_set():
                return
        log.info("compiling serving kernels, %s, about %d s on an idle 2-core machine (numba caches them: later "
                 "starts load them in about 1 s)", self.when, COLD_COMPILE_S)
        while not self._done.wait(PROGRESS_EVERY_S):
            log.info("compiling serving kernels: %s, %.0f s so far", self.current, time.perf_counter() - self.started)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def warm_all(when: str = "first start only") -> dict[str, float]:
    """Run every warm-up of :data:`WARM_UPS`; returns the seconds each took (compiling, or loading from cache).
    ``when`` says in the first progress line when such a compile happens (a start, an install)."""
    took: dict[str, float] = {}
    compiles = _Compiles()
    event.register("numba:compile", compiles)
    progress = _Progress(compiles, when)
    try:
        for i, (name, target) in enumerate(WARM_UPS.items(), 1):
            progress.current = f"{name} ({i} of {len(WARM_UPS)})"
            started = time.perf_counter()
            _resolve(target)()
            took[name] = time.perf_counter() - started
    finally:
        progress.stop()
        event.unregister("numba:compile", compiles)
    how = f"compiled ({compiles.count} compiles) and cached" if compiles.count else "loaded from numba's cache"
    log.info("serving kernels %s in %.1f s (%s)", how, time.perf_counter() - progress.started,
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
    """``python -m hps_service.jit.warmup``: warm every kernel into numba's cache (``make install`` and the Docker
    build do, so that ``hps serve`` loads them)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    warm_all(when="first install only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
