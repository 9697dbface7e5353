"""L1 read from the shared store by a process that is not its writer (a worker, or a colocated LocalClient).

The cache's own compiled query (``cache.cpu_kernels.query_kernel``) is a sequence-lock read: it reports a read a
writer overlapped instead of returning it. In the owner a reader that keeps overlapping waits on the writers'
mutex; across processes there is no such mutex, so a reader backs off with short sleeps until the writer is done.
A worker touches the clocks of its hits (its mapping of ``clock`` and ``meta`` is writable); a read-only reader
does not (its hits do not count for LRU/LFU). Rows a worker fetched below L1 are offered to the owner, which
decides what enters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hps_client.buffers import check_out
from hps_service.cache.layout import CacheArrays
from hps_service.cache.set_assoc import READ_ATTEMPTS, SetAssociativeCache
from hps_service.errors import InvalidArgumentError

#: Back-off of a reader that keeps overlapping writes (doubling up to the cap).
_SLEEP_S, _SLEEP_CAP_S = 20e-6, 2e-3
_INT64 = np.dtype(np.int64)

#: ``offer(keys, versions, vectors, batch_hit_rate, fetched_at)``: hand fetched rows to the owner.
Offer = Callable[[np.ndarray, np.ndarray, np.ndarray, float, int], None]
#: The fields of CacheArrays a worker maps writable (clock touches, the tick); all others stay read-only.
WORKER_WRITABLE = ("clock", "meta")


def cache_entry(arrays_spec: dict[str, Any], arrays: CacheArrays, policy: str) -> dict[str, Any]:
    """The manifest entry of a table's L1 (its arrays and geometry)."""
    return {"arrays": arrays_spec, "writable": list(WORKER_WRITABLE), "capacity": arrays.capacity,
            "ways": arrays.ways, "dim": arrays.dim, "policy": policy}


class SharedL1Reader:
    """The TableCache a reader process sees: lookups from the shared arrays, admissions handed to the owner."""

    def __init__(self, arrays: dict[str, np.ndarray], entry: dict[str, Any], generation: Callable[[], int],
                 offer: Offer | None, touch: bool) -> None:
        fields = {name: arrays[name] for name in ("tags", "keys", "versions", "clock", "values", "meta")}
        if not touch:
            # The compiled query touches clocks only when asked to, but compiles that store whatever it is given:
            # a read-only reader hands it a writable stand-in (one element, zero strides) it never writes.
            fields["clock"] = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), shape=arrays["clock"].shape,
                                                              strides=(0, 0), writeable=True)
        cache_arrays = CacheArrays(**fields)
        self._cache = SetAssociativeCache(int(entry["capacity"]), int(entry["dim"]), ways=int(entry["ways"]),
                                          policy=entry["policy"], arrays=cache_arrays)
        self.dim = self._cache.dim
        self.capacity = self._cache.capacity
        self._generation = generation
        self._offer = offer
        self._touch = touch
        #: One attempt of :meth:`read` as one C call, ``read_once(keys, out, hit) -> hits, or -1`` when a writer
        #: overlapped it (then :meth:`read`): for a caller whose checks are done, as :meth:`read` asks.
        self.read_once = self._cache.bound_query(touch)
        self.retries = 0

    def lookup(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows of ``keys`` into ``out[i]`` where hit; return the hit mask (misses' rows unspecified)."""
        if not (type(keys) is np.ndarray and keys.dtype is _INT64 and keys.ndim == 1 and keys.flags.c_contiguous):
            raise InvalidArgumentError("keys must be a C-contiguous 1-D int64 array")
        n = keys.shape[0]
        check_out(out, n, self.dim)
        hit = np.empty(n, dtype=np.bool_)
        self.read(keys, out, hit)
        return hit

    def read(self, keys: np.ndarray, out: np.ndarray, hit: np.ndarray) -> int:
        """:meth:`lookup` into the caller's ``hit`` mask, with no argument checks (the caller's are done: int64
        C-contiguous keys, writable float32 C-contiguous ``out`` of ``(n, dim)``, bool ``hit`` of ``(n,)``; the
        compiled query trusts them); returns the number of hits. The one call a colocated all-hit read makes."""
        nhit: int = self.read_once(keys, out, hit)
        attempt = 0
        sleep = _SLEEP_S
        while nhit < 0:
            self.retries += 1
            attempt += 1
            if attempt >= READ_ATTEMPTS:
                time.sleep(sleep)
                sleep = min(2 * sleep, _SLEEP_CAP_S)
            nhit = self.read_once(keys, out, hit)
        return nhit

    def generation(self) -> int:
        """The owner's published change generation (never ahead of the owner's own)."""
        return self._generation()

    def admit(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, batch_hit_rate: float, *,
              fetched_at: int | None = None) -> None:
        """Hand rows fetched below L1 to the owner, which admits them as it admits its own."""
        if self._offer is not None and keys.shape[0]:
            self._offer(np.ascontiguousarray(keys, dtype=np.int64), np.ascontiguousarray(versions, dtype=np.int64),
                        np.ascontiguousarray(vectors, dtype=np.float32), float(batch_hit_rate),
                        0 if fetched_at is None else int(fetched_at))

    def update(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> None:
        raise InvalidArgumentError("only the node's owner process writes L1")

    def invalidate(self, keys: np.ndarray, versions: np.ndarray | None = None) -> None:
        raise InvalidArgumentError("only the node's owner process writes L1")

    def clear(self) -> None:
        raise InvalidArgumentError("only the node's owner process writes L1")

    def stats(self) -> dict[str, float | str]:
        return self._cache.stats()

    def host_share(self) -> None:
        """A reader shares nothing on: the owner publishes these arrays."""
        return None

    def close(self) -> None:
        return None

    def hottest_keys(self) -> np.ndarray:
        """None ranked here: the owner warms a new version's L1 from its own cache, this reader only maps it."""
        return np.empty(0, dtype=np.int64)
