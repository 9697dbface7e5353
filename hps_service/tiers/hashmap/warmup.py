"""Compiling the hash map tier's kernels ahead of serving (``hps warmup``, the fork server), with the argument types
the engine passes them."""

from __future__ import annotations

import numpy as np

from hps_service.tiers.hashmap.tier import INITIAL_ROWS, HashMapTier


def warm_up_kernels() -> None:
    """Compile (or load) every kernel of the tier with the argument types the engine passes: a table that grows
    its index and evicts, gets, the compiled pass, puts (new, replacing, refused), versioned and unversioned deletes, each with writable
    and read-only inputs (the tier passes both to its kernels read-only: see hps_service.jit.views)."""
    from hps_service.jit.warmup import read_only

    tier = HashMapTier(capacity_rows=INITIAL_ROWS * 2)
    try:
        tier.create_table("warm.up", 2)
        for variant in (np.asarray, read_only):
            keys = np.arange(INITIAL_ROWS * 3, dtype=np.int64)
            for lo in range(0, keys.shape[0], INITIAL_ROWS):
                chunk = keys[lo : lo + INITIAL_ROWS]
                ones = np.ones((chunk.shape[0], 2), np.float32)
                tier.put("warm.up", variant(chunk), variant(ones), variant(np.full(chunk.shape[0], 2, np.int64)))
            few = variant(keys[-4:])
            tier.get("warm.up", few)
            tier.fill("warm.up", few, np.arange(4), np.empty((4, 2), np.float32), np.empty(4, np.int64),
                      np.empty(4, np.bool_))
            tier.lane("warm.up")(read_only(few), np.empty((4, 2), np.float32), np.empty(4, np.uint8),
                                 np.empty(4, np.int64))
            tier.put("warm.up", few, variant(np.ones((4, 2), np.float32)), variant(np.ones(4, np.int64)))
            tier.delete("warm.up", few[:2], variant(np.full(2, 3, np.int64)))
            tier.delete("warm.up", few[2:])
            tier.scan_keys("warm.up", 4)
    finally:
        tier.close()
