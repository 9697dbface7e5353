"""``make bench`` part 11e: ``LocalClient`` against the raw NumPy gather at every batch size from 256 to 16384 (issue
29, item 5: at least 0.5x at each), beside the bare compiled read the client runs (its limit: the L1 query, or the
hash map's pass without L1), every key held, the contenders interleaved in rounds. The client reads into a reused buffer (``out=``), as the gather does."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: The batch sizes of the target.
BATCHES = (256, 1024, 4096, 16384)
TARGET = 0.5


def interleaved_us(contenders: dict[str, Callable[[int], object]], seconds: float) -> dict[str, float]:
    """Microseconds per call of each contender (called with a running count), after 8 warm-up calls each, in 3
    interleaved rounds of ``seconds / 3`` per contender."""
    spent = {name: 0.0 for name in contenders}
    calls = {name: 0 for name in contenders}
    for fn in contenders.values():
        for j in range(8):
            fn(j)
    for _ in range(3):
        for name, fn in contenders.items():
            j, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 3:
                fn(j)
                j += 1
            spent[name] += time.perf_counter() - t0
            calls[name] += j
    return {name: 1e6 * spent[name] / calls[name] for name in contenders}


def _one_batch(local: Any, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, batch: int,
               seconds: float, rng: np.random.Generator) -> dict[str, Any]:
    idx = [rng.integers(0, keys.shape[0], batch) for _ in range(32)]
    asked = [keys[i] for i in idx]
    # every batch checked and its share of the first level kept (L1, or the hash map without L1): one key outside it
    # sends a whole call down the general path
    local.lookup(model, table, asked[0])  # maps the table
    first = 1 if local.colocated._tables[(model, table, None, "")].served.cache is not None else 2
    l1_share = []
    for i, a in zip(idx, asked):
        got = local.lookup_with_sources(model, table, a)
        np.testing.assert_array_equal(got.vectors, vectors[i])
        l1_share.append(float(np.mean(got.sources == first)))
    mapped = local.colocated._tables[(model, table, None, "")]  # what LocalClient runs: its bare compiled read
    client_out, gather_out, query_out = (np.empty((batch, vectors.shape[1]), np.float32) for _ in range(3))
    hit, sources, miss = np.empty(batch, np.bool_), np.empty(batch, np.uint8), np.empty(batch, np.intp)
    frozen = [a.copy() for a in asked]
    for a in frozen:
        a.flags.writeable = False
    l1 = mapped.served.cache
    query: Callable[[int], object] = (
        (lambda j: l1._cache.query_once(asked[j % 32], query_out, hit, False)) if l1 is not None
        else (lambda j: mapped.lane(frozen[j % 32], query_out, sources, miss)))
    us = interleaved_us({
        "gather": lambda j: np.take(vectors, idx[j % 32], axis=0, out=gather_out, mode="clip"),
        "local": lambda j: local.lookup(model, table, asked[j % 32], out=client_out),
        "query": query,
    }, seconds)
    return {"batch": batch, "us": us, "l1_share": float(np.mean(l1_share)),
            "all_hit_batches": sum(share == 1.0 for share in l1_share) / len(l1_share),
            "local_vs_gather": us["gather"] / us["local"], "query_vs_gather": us["gather"] / us["query"],
            "target": TARGET}


def measure(store: Path, keys_file: Path, model: str, table: str, seconds: float,
            batches: tuple[int, ...] = BATCHES) -> list[dict[str, Any]]:
    """Per batch: microseconds per call of the gather, LocalClient.lookup(out=) and the bare compiled read, and the
    client's speed relative to the gather (gather time / client time); ``seconds`` in all."""
    from hps_service.local import LocalClient

    with np.load(keys_file) as archive:
        keys, vectors = archive["keys"], np.ascontiguousarray(archive["vectors"], dtype=np.float32)
    rng = np.random.default_rng(11)
    with LocalClient(store) as local:
        assert local.mapped, "the store is not mapped"
        return [_one_batch(local, model, table, keys, vectors, batch, seconds / len(batches), rng)
                for batch in batches]
