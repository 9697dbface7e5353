"""Key -> partition routing shared by the publisher, the consumer's shard, the importer and the trainer.

The functions live in the client-only package (``hps_client.partitioning``: the client routes keys to shards with
them); see there for the formula. ``group_by_partition`` orders a batch for one message per partition.
"""

from __future__ import annotations

import numpy as np

from hps_client.partitioning import murmur2, partition_of, shard_ids, shard_of

__all__ = ["group_by_partition", "murmur2", "partition_of", "shard_ids", "shard_of"]


def group_by_partition(partition: np.ndarray, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """A stable order that groups rows by partition, and the start offset of each partition in that order.

    Rows of partition p are ``order[starts[p]:starts[p + 1]]``, in their original order.
    """
    order = np.argsort(partition, kind="stable")
    counts = np.bincount(partition, minlength=partitions)
    starts = np.zeros(partitions + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return order, starts
