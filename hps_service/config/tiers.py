"""The storage tiers' config sections: ``volatile`` (L2: hash map or Redis Cluster, each backend's settings a model of
its own, told apart by ``type``) and ``persistent`` (L3: RocksDB and its snapshots)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, SecretStr, Tag, field_validator, model_validator

from hps_service.config.base import Section as _Section
from hps_service.config.secrets import load_secret_files


class HashMapVolatile(_Section):
    """L2 in this node's memory: a bounded hash map per table (the node's workers read the owner's)."""

    type: Literal["hashmap"] = Field("hashmap", description="an in-process hash map per table")
    capacity_rows: int = Field(10_000_000, ge=1, description="rows per table (address space reserved, memory used as "
                               "rows arrive; a table that fits is filled from RocksDB at load)")
    capacity_mb: int | None = Field(None, ge=1, description="a memory budget per table (its rows, keys, versions, "
                                    "stamps and index); the table holds the fewer of capacity_rows and the rows "
                                    "that fit, so fp16 / int8 tables hold 2-3x more rows")
    overflow_policy: Literal["lru", "lfu"] = Field("lru", description="which rows a full table evicts")
    overflow_evict_fraction: float = Field(0.1, gt=0.0, le=0.5, description="share evicted at once")


class RedisClusterVolatile(_Section):
    """L2 in a Redis Cluster shared by every pod."""

    type: Literal["redis_cluster"] = Field(description="a Redis Cluster")
    nodes: list[str] = Field(min_length=1, description="host:port seeds")
    partitions: int = Field(64, ge=1, le=16384, description="hashes per table")
    password: SecretStr | None = Field(None, description="AUTH password (prefer password_file)")
    password_file: Path | None = Field(None, description="a file holding the password")
    username: str | None = Field(None, description="ACL user (Redis 6+) for AUTH with password")
    tls: bool = Field(False, description="connect with TLS")
    ca_file: Path | None = Field(None, description="PEM CA bundle that verifies the nodes (TLS)")
    socket_timeout_s: float = Field(0.5, gt=0, description="per-command socket timeout")
    node_retry_after_s: float = Field(1.0, ge=0, description="skip a failed node this long")

    @model_validator(mode="after")
    def _nodes(self) -> RedisClusterVolatile:
        load_secret_files(self, "volatile", "password")
        for node in self.nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"volatile.nodes entry {node!r} is not host:port")
        return self


class NoVolatile(_Section):
    """No L2: lookups L1 misses go to the persistent tier."""

    type: Literal["disabled"] = Field(description="no volatile tier")


#: The backends' config models by ``type`` (their tiers: :mod:`hps_service.tiers.registry`).
VOLATILE_TYPES = ("hashmap", "redis_cluster", "disabled")


def _volatile_type(value: Any) -> str:
    """The ``type`` of a volatile section (a dict before validation, a model after): ``hashmap`` when unnamed."""
    return str(value.get("type", "hashmap") if isinstance(value, dict) else getattr(value, "type", "hashmap"))


#: ``volatile``: one backend's settings, told apart by ``type`` (none: hashmap); a key of another backend is refused.
VolatileConfig = Annotated[
    Annotated[HashMapVolatile, Tag("hashmap")] | Annotated[RedisClusterVolatile, Tag("redis_cluster")]
    | Annotated[NoVolatile, Tag("disabled")],
    Discriminator(_volatile_type, custom_error_type="volatile_type",
                  custom_error_message=f"volatile.type must be one of {', '.join(VOLATILE_TYPES)}"),
]


class PersistentConfig(_Section):
    """L3: RocksDB, one column family per model.table."""

    type: Literal["rocksdb", "disabled"] = Field("rocksdb", description="disabled is refused with Kafka updates")
    path: Path = Field(Path("./var/rocksdb"), description="the RocksDB directory (one writer process)")
    read_only: bool = Field(False, description="open RocksDB read-only: no imports, updates or admin writes")
    block_cache_mb: int = Field(256, ge=0, description="RocksDB block cache, divided among the worker processes")
    sync_writes: bool = Field(True, description="fsync the WAL on every update batch before its offset is committed")
    max_total_wal_mb: int = Field(
        256, ge=1, description="RocksDB flushes the column families that keep the oldest write-ahead log once the "
        "logs total more: the stored positions are written with every batch and never fill a memtable, so without "
        "this bound every log since their last flush is kept (a soak at 10k rows/s held 2.3 GB of logs for 3 MB of "
        "rows, which a restart replays and each worker's secondary instance holds as memtables)")
    write_buffer_mb: float = Field(
        64.0, ge=0.0625, le=65536, description="a table's rows are flushed from memory (its memtable) to a file once "
        "they take this much; every flush also sets what a worker's RocksDB secondary instance must replay")
    change_ring_keys: int = Field(
        65536, ge=16, le=1 << 24, description="keys of the latest RocksDB writes a node keeps per table for its "
        "workers (8 bytes each): a worker whose secondary instance fell further behind catches up before any read")
    snapshot_store: str | None = Field(
        None, description="s3://BUCKET/PREFIX where snapshots are uploaded and an empty store bootstraps from "
        "(endpoint and credentials from the standard AWS environment, AWS_ENDPOINT_URL included)")
    snapshot_interval_s: float = Field(0.0, ge=0.0, description="take and upload a snapshot this often (0 = off)")
    snapshot_retain: int = Field(3, ge=1, description="newest snapshots kept in the store per model")
    snapshot_upload_bytes_per_s: int = Field(
        0, ge=0, description="bandwidth cap of a snapshot upload, so it leaves room for serving (0 = unlimited)")
    s3_access_key_id: SecretStr | None = Field(None, description="snapshot store credentials; default: the AWS "
                                               "environment (AWS_ACCESS_KEY_ID, IRSA, ...)")
    s3_access_key_id_file: Path | None = Field(None, description="a file holding s3_access_key_id")
    s3_secret_access_key: SecretStr | None = Field(None, description="goes with s3_access_key_id")
    s3_secret_access_key_file: Path | None = Field(None, description="a file holding s3_secret_access_key")

    @model_validator(mode="after")
    def _s3_secret_files(self) -> PersistentConfig:
        load_secret_files(self, "persistent", "s3_access_key_id", "s3_secret_access_key")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("persistent.s3_access_key_id and s3_secret_access_key go together")
        return self

    @field_validator("snapshot_store")
    @classmethod
    def _s3_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", v):
            raise ValueError(f"must be s3://BUCKET[/PREFIX] with a valid bucket name, got {v!r}")
        return v
