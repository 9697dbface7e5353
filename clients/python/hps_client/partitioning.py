"""Where a key lives: ``partition(key) = (murmur2(key as 8 big-endian bytes) & 0x7fffffff) % P`` and
``shard(key) = partition(key) % S``.

murmur2 is Kafka's (Java's ``Utils.murmur2``, librdkafka's ``murmur2_random``), so this is Kafka's default
partitioner for a record keyed by those 8 bytes: producers in any language, the servers' shards and this client agree
on where a key lives (protos/hps/v1/update.proto). Vectorised in NumPy: no Python loop per key.
"""

from __future__ import annotations

import numpy as np

_M = np.uint32(0x5BD1E995)
#: Kafka's murmur2 state after its first step: (seed 0x9747b28c ^ length 8) * m.
_H0_TIMES_M = np.uint32(((0x9747B28C ^ 8) * 0x5BD1E995) & 0xFFFFFFFF)


def murmur2(keys: np.ndarray) -> np.ndarray:
    """Kafka's murmur2 of each int64 key's 8 big-endian bytes, as uint32 (vectorised, no loop per key)."""
    # murmur2 reads the 8 bytes as two little-endian 4-byte blocks; NumPy's uint32 arithmetic wraps like Java's int
    k = np.ascontiguousarray(keys, dtype=">i8").view("<u4").reshape(-1, 2) * _M
    k ^= k >> np.uint32(24)
    k *= _M
    h = k[:, 0] ^ _H0_TIMES_M
    h *= _M
    h ^= k[:, 1]
    h ^= h >> np.uint32(13)
    h *= _M
    h ^= h >> np.uint32(15)
    return h


def _partition(keys: np.ndarray, partitions: int) -> np.ndarray:
    """``(murmur2 & 0x7fffffff) % partitions`` as uint32 (computed in place on the hash)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    h = murmur2(keys)
    h &= np.uint32(0x7FFFFFFF)
    h %= np.uint32(partitions)
    return h


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of every key (int64 array in, int32 array out): Kafka's default partitioner; see module doc."""
    return _partition(keys, partitions).astype(np.int32)


def shard_ids(keys: np.ndarray, partitions: int, shards: int) -> np.ndarray:
    """The shard of every key as uint16 (what a stable argsort orders fastest); no hashing when unsharded."""
    if shards < 1 or shards > 65535 or partitions % shards:
        raise ValueError(f"partitions ({partitions}) must be a positive multiple of shards ({shards}, at most 65535)")
    if shards == 1:
        return np.zeros(np.shape(keys)[0], dtype=np.uint16)
    h = _partition(keys, partitions)
    h %= np.uint32(shards)
    return h.astype(np.uint16)


def shard_of(keys: np.ndarray, partitions: int, shards: int) -> np.ndarray:
    """The shard of every key: ``partition_of(keys, partitions) % shards`` (int32)."""
    return shard_ids(keys, partitions, shards).astype(np.int32)
