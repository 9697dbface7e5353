"""Which keys this process serves: ``shard(key) = partition(key) % shards`` (cluster config), and the checks that
make misrouting loud instead of answering another shard's key with a default vector."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hps_service.config import ClusterConfig
from hps_service.errors import FailedPreconditionError
from hps_service.updates.partitioning import shard_ids

#: Example keys named per owning shard in a WrongShardError message.
_EXAMPLES = 3


class WrongShardError(FailedPreconditionError):
    """Keys of another shard were sent here; ``owners`` maps each owning shard to how many of the keys it holds."""

    def __init__(self, message: str, owners: dict[int, int]) -> None:
        super().__init__(message)
        self.owners = owners


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Shard ``shard`` of ``shards`` over ``partitions`` partitions (P % S == 0, checked by the config)."""

    shards: int = 1
    shard: int = 0
    partitions: int = 1

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> ShardMap:
        return cls(shards=cfg.shards, shard=cfg.shard, partitions=cfg.partitions)

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def owned_partitions(self) -> list[int]:
        """The partitions of every update topic this shard consumes."""
        return [p for p in range(self.partitions) if p % self.shards == self.shard]

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        """The shard of each key (uint16)."""
        return shard_ids(keys, self.partitions, self.shards)

    def owned(self, keys: np.ndarray) -> np.ndarray:
        """A boolean mask of the keys this shard serves (all of them when unsharded)."""
        if not self.sharded:
            return np.ones(np.shape(keys)[0], dtype=bool)
        served: np.ndarray = self.shard_of(keys) == self.shard
        return served

    def check(self, keys: np.ndarray, what: str = "keys") -> None:
        """Raise WrongShardError naming the owning shards when any of ``keys`` is not served here."""
        if not self.sharded or np.shape(keys)[0] == 0:
            return
        shards = self.shard_of(keys)
        foreign = shards != self.shard
        if not foreign.any():
            return
        counts = np.bincount(shards[foreign], minlength=self.shards)
        owners = {int(s): int(counts[s]) for s in np.flatnonzero(counts)}
        parts = []
        for s, n in owners.items():
            examples = ", ".join(str(int(k)) for k in np.asarray(keys)[foreign & (shards == s)][:_EXAMPLES])
            parts.append(f"shard {s} owns {n} (e.g. {examples})")
        raise WrongShardError(
            f"{sum(owners.values())} of {np.shape(keys)[0]} {what} belong to another shard: {'; '.join(parts)}. "
            f"This server is shard {self.shard} of {self.shards} (shard = partition(key) % {self.shards} "
            f"with P = {self.partitions}); send each key to its shard (HPSClient routes by GetClusterInfo)",
            owners,
        )

    def keep_owned(self, keys: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The rows of ``keys``/``vectors`` this shard serves, and how many rows were left out."""
        if not self.sharded:
            return keys, vectors, 0
        idx = np.flatnonzero(self.owned(keys))
        return keys[idx], vectors[idx], int(keys.shape[0] - idx.shape[0])
