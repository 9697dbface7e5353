"""Key -> partition routing shared by the publisher and tests: a splitmix64 hash of the key, modulo partitions."""

from __future__ import annotations

import numpy as np


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of every key (int64 array in, int32 array out), vectorised; stable across processes."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    with np.errstate(over="ignore"):
        z = np.asarray(keys, dtype=np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(partitions)).astype(np.int32)


def group_by_partition(partition: np.ndarray, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """A stable order that groups rows by partition, and the start offset of each partition in that order.

    Rows of partition p are ``order[starts[p]:starts[p + 1]]``, in their original order.
    """
    order = np.argsort(partition, kind="stable")
    counts = np.bincount(partition, minlength=partitions)
    starts = np.zeros(partitions + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return order, starts
