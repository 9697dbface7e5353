"""The shared L2 volatile tier on a Redis Cluster: partitioned hashes, pipelined per node, versioned writes.

Layout: table ``T`` is split into ``partitions`` hashes ``hps:{T:p}`` (``p = key mod partitions``); the hash tag
puts one partition in one slot, so one HMGET/script call serves every key of a partition. Fields are 8-byte
big-endian keys, values are ``codec`` rows (int64 LE version + float32 vector) or tombstones (the 8 version
bytes alone, left by a versioned delete). Each partition hash counts its tombstones in the field
``#tombstones`` (never an 8-byte key), so ``count`` excludes them. ``hps:meta:{T}`` holds the dim.

Tombstones carry no TTL (Redis 7.0 has no per-field expiry, and an expired tombstone would reopen the key to
replays): each is a field of 8 + 8 bytes plus the hash entry overhead, and it is replaced by the next newer
put of its key, removed by an unversioned delete, or by :meth:`RedisClusterTier.purge_tombstones`.

The Lua scripts are in :mod:`.scripts`, the RESP framing in :mod:`.resp`, and the nodes (routing, the one round
trip per batch, back-off of failed nodes) in :mod:`.topology`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.crc import key_slot
from redis.exceptions import RedisError

from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.keys import as_keys
from hps_service.tiers import base, codec
from hps_service.tiers.base import MissedWrites, Rows, Tier, TierStats, delete_versions, max_version_per_key
from hps_service.tiers.redis.resp import key_bytes, resp_bulk_columns, resp_command
from hps_service.tiers.redis.scripts import (
    DELETE_LUA,
    DELETE_VERSIONED_LUA,
    PURGE_LUA,
    PUT_IF_NOT_OLDER_LUA,
    TOMBSTONE_COUNT_FIELD,
    Script,
)
from hps_service.tiers.redis.topology import ClusterNodes, Failed

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _TableLayout:
    """Where a table's partitions live: hash names and their cluster slots."""

    dim: int
    hashes: list[bytes]
    slots: list[int]
    hashes_resp: list[bytes]  # each hash name as a RESP bulk string


def _check_table_name(table: str) -> None:
    if not table or "{" in table or "}" in table:
        raise InvalidArgumentError(f"table name {table!r} must be non-empty and contain no braces")


class RedisClusterTier(Tier):
    """Versioned embedding rows in a Redis Cluster, read and written one pipelined round trip per batch."""

    kind = "volatile"
    capabilities = base.TierCapability.WRITES

    def __init__(
        self,
        nodes: list[str],
        partitions: int = 64,
        password: str | None = None,
        socket_timeout_s: float = 0.5,
        node_retry_after_s: float = 1.0,
        **connection_options: object,
    ) -> None:
        """``connection_options`` go to every node connection: ``username`` (ACL AUTH), ``ssl``, ``ssl_ca_certs``."""
        if not nodes:
            raise InvalidArgumentError("redis_cluster tier needs at least one node (host:port)")
        if not 1 <= partitions <= 16384:
            raise InvalidArgumentError(f"partitions must be in [1, 16384], got {partitions}")
        if socket_timeout_s <= 0 or node_retry_after_s < 0:
            raise InvalidArgumentError("socket_timeout_s must be > 0 and node_retry_after_s >= 0")
        self._partitions = partitions
        self._nodes = ClusterNodes(nodes, password, socket_timeout_s, node_retry_after_s, **connection_options)
        self._rc = self._nodes.rc
        self._put_script = Script.of(PUT_IF_NOT_OLDER_LUA)
        self._delete_versioned_script = Script.of(DELETE_VERSIONED_LUA)
        self._delete_script = Script.of(DELETE_LUA)
        self._purge_script = Script.of(PURGE_LUA)
        self._nodes.load_scripts(
            self._put_script,
            self._delete_versioned_script,
            self._delete_script,
            self._purge_script,
        )
        self._tables: dict[str, _TableLayout] = {}
        #: Keys whose put/delete could not reach their node: they may hold stale rows once the node is back.
        self._missed = MissedWrites("redis_cluster")

    # ------------------------------------------------------------------ tables

    def create_table(self, table: str, dim: int) -> None:
        """Record ``dim`` in the table's meta key (or check it against the stored one)."""
        _check_table_name(table)
        if dim <= 0:
            raise InvalidArgumentError(f"dim of table {table!r} must be positive, got {dim}")
        try:
            self._rc.set(self._meta_key(table), str(dim).encode(), nx=True)
            raw = self._rc.get(self._meta_key(table))
            stored = dim if raw is None else int(raw)  # None: the meta key was deleted since the SET NX
        except RedisError as e:
            log.warning(
                "redis_cluster: meta of table %s not reachable (%s); using dim %d locally", table, e, dim
            )
            stored = dim
        if stored != dim:
            raise InvalidArgumentError(f"table {table!r} exists in Redis with dim {stored}, asked for {dim}")
        self._tables[table] = self._layout(table, dim)

    def drop_table(self, table: str) -> None:
        """Delete every partition hash and the meta key of ``table``."""
        layout = self._table(table)
        commands = [(slot, [resp_command(b"DEL", h)]) for h, slot in zip(layout.hashes, layout.slots)]
        results = self._nodes.execute(table, commands, keys_per_command=None)
        failed = sum(isinstance(r, (Failed, Exception)) for r in results)
        if failed:
            raise UnavailableError(
                f"drop of table {table!r} reached only part of the cluster ({failed} failed)"
            )
        try:
            self._rc.delete(self._meta_key(table))
        except RedisError as e:
            raise UnavailableError(f"drop of table {table!r}: meta key not deleted: {e}") from e
        self._tables.pop(table, None)

    # ------------------------------------------------------------------ rows

    def get(self, table: str, keys: np.ndarray) -> Rows:
        """HMGET per partition, all nodes in one round trip; keys on failed nodes come back not found."""
        keys = as_keys(keys)
        layout = self._table(table)
        n = keys.size
        if n == 0:
            return Rows.empty(0, layout.dim)
        order, parts, bounds = self._group(keys)
        fields = resp_bulk_columns(n, key_bytes(keys[order]))
        commands = [
            (layout.slots[p], [b"*%d\r\n$5\r\nHMGET\r\n" % (e - s + 2), layout.hashes_resp[p], fields[s:e]])
            for p, s, e in zip(parts, bounds[:-1], bounds[1:])
        ]
        results = self._nodes.execute(table, commands, keys_per_command=np.diff(bounds))
        values: list[bytes | None] = []
        for res, s, e in zip(results, bounds[:-1], bounds[1:]):
            values.extend(res if isinstance(res, list) else [None] * int(e - s))
        sorted_rows = codec.decode_rows(values, layout.dim)
        rows = Rows(
            vectors=np.empty((n, layout.dim), dtype=np.float32),
            versions=np.empty(n, dtype=np.int64),
            found=np.empty(n, dtype=bool),
        )
        rows.vectors[order] = sorted_rows.vectors
        rows.versions[order] = sorted_rows.versions
        rows.found[order] = sorted_rows.found
        return rows

    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Write rows whose stored version is not newer (one script call per partition); returns the written mask."""
        keys = as_keys(keys)
        layout = self._table(table)
        n = keys.size
        vectors = np.asarray(vectors, dtype=np.float32)
        versions = np.asarray(versions)
        if vectors.shape != (n, layout.dim):
            raise InvalidArgumentError(
                f"vectors for table {table!r} must have shape ({n}, {layout.dim}), got {vectors.shape}"
            )
        if versions.shape != (n,) or (n and versions.dtype.kind not in "iu"):
            raise InvalidArgumentError(
                f"versions must be {n} integers, got shape {versions.shape} dtype {versions.dtype}"
            )
        written = np.zeros(n, dtype=bool)
        if n == 0:
            return written
        order, parts, bounds = self._group(keys)
        records = np.empty(n, dtype=codec.row_dtype(layout.dim))
        records["version"] = versions[order]
        records["vector"] = vectors[order]
        field_values = resp_bulk_columns(
            n, key_bytes(keys[order]), records.view(np.uint8).reshape(n, records.dtype.itemsize)
        )
        results = self._run_script(table, layout, self._put_script, parts, bounds, field_values, 2)
        self._note_missed(table, results, bounds, keys[order])
        written[order] = self._flags(results, bounds, n)
        return written

    def delete(self, table: str, keys: np.ndarray, versions: np.ndarray | None = None) -> int:
        """One script call per partition in one round trip; returns live rows removed on the reachable nodes.

        With ``versions``: rows not newer become tombstones (absent keys get one). Without: rows and tombstones
        are removed.
        """
        keys = as_keys(keys)
        layout = self._table(table)
        tomb_versions = delete_versions(versions, keys.size)
        if keys.size == 0:
            return 0
        if tomb_versions is None:
            keys = np.unique(keys)
            order, parts, bounds = self._group(keys)
            fields = resp_bulk_columns(keys.size, key_bytes(keys[order]))
            results = self._run_script(table, layout, self._delete_script, parts, bounds, fields, 1)
            self._note_missed(table, results, bounds, keys[order])
            return sum(r for r in results if isinstance(r, int))
        keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        order, parts, bounds = self._group(keys)
        tombstones = np.ascontiguousarray(tomb_versions[order], dtype="<i8").view(np.uint8).reshape(-1, 8)
        field_values = resp_bulk_columns(keys.size, key_bytes(keys[order]), tombstones)
        results = self._run_script(
            table, layout, self._delete_versioned_script, parts, bounds, field_values, 2
        )
        self._note_missed(table, results, bounds, keys[order])
        return int(np.count_nonzero(self._flags(results, bounds, keys.size)))

    def purge_tombstones(self, table: str, below_version: int, page: int = 1000) -> int:
        """Remove tombstones older than ``below_version`` from every reachable partition; returns how many.

        Walks each partition with HSCAN pages of ``page`` fields, one script call per page (all partitions of
        a step in one round trip), so no call blocks a node for long.
        """
        layout = self._table(table)
        version = int(below_version).to_bytes(8, "little", signed=True)
        version_resp = b"$8\r\n%s\r\n" % version
        page_resp = b"$%d\r\n%d\r\n" % (len(str(page)), page)
        cursors = dict.fromkeys(range(len(layout.hashes)), b"0")
        purged = 0
        while cursors:
            parts = list(cursors)
            commands = [
                (
                    layout.slots[p],
                    [b"*7\r\n", self._purge_script.evalsha_head(), layout.hashes_resp[p], version_resp,
                     b"$%d\r\n%s\r\n" % (len(cursors[p]), cursors[p]), page_resp],
                )
                for p in parts
            ]  # fmt: skip
            results = self._nodes.execute_script(table, self._purge_script, commands, None)
            next_cursors = {}
            for p, res in zip(parts, results):
                if not isinstance(res, list):
                    continue  # an unreachable partition is left for a later purge
                purged += int(res[1])
                if res[0] != b"0":
                    next_cursors[p] = res[0]
            cursors = next_cursors
        return purged

    def count(self, table: str) -> int:
        """Live rows on the reachable nodes: HLEN of each partition less its tombstones and their counter field."""
        layout = self._table(table)
        lengths = [(slot, [resp_command(b"HLEN", h)]) for h, slot in zip(layout.hashes, layout.slots)]
        counters = [
            (slot, [resp_command(b"HGET", h, TOMBSTONE_COUNT_FIELD)])
            for h, slot in zip(layout.hashes, layout.slots)
        ]
        results = self._nodes.execute(table, lengths + counters, keys_per_command=None)
        total = 0
        for fields, tombstones in zip(results[: len(lengths)], results[len(lengths) :]):
            if isinstance(fields, int) and not isinstance(tombstones, (Failed, Exception)):
                total += fields - (1 + int(tombstones) if tombstones is not None else 0)
        return total

    def tombstones(self, table: str) -> int:
        """Tombstones held on the reachable nodes (the partitions' ``#tombstones`` counters)."""
        layout = self._table(table)
        commands = [
            (slot, [resp_command(b"HGET", h, TOMBSTONE_COUNT_FIELD)])
            for h, slot in zip(layout.hashes, layout.slots)
        ]
        results = self._nodes.execute(table, commands, keys_per_command=None)
        return sum(int(r) for r in results if isinstance(r, bytes))

    def stats(self, table: str) -> TierStats:
        """Rows (reachable nodes), no capacity bound; errors = node batches that fell through (failed or skipped)."""
        errors, extra = self._nodes.failure_stats(table)
        return TierStats(rows=self.count(table), capacity=None, errors=errors, extra=extra)

    def healthy(self) -> bool:
        """True while at least one primary answers PING (a failed node only turns its keys into misses)."""
        return self._nodes.healthy()

    def close(self) -> None:
        """Close every node connection pool."""
        self._nodes.close()

    # ------------------------------------------------------------------ internals

    def _note_missed(self, table: str, results: list[Any], bounds: np.ndarray, sorted_keys: np.ndarray) -> None:
        """Remember the keys of partition writes that failed or were skipped."""
        bad = [i for i, r in enumerate(results) if not isinstance(r, (bytes, int, list))]
        if not bad:
            return
        self._missed.add(table, np.concatenate([sorted_keys[bounds[i] : bounds[i + 1]] for i in bad]))

    def take_missed_writes(self, table: str) -> np.ndarray:
        """Keys whose writes missed a node, handed over once every node answers again (none while one is down)."""
        if self._nodes.any_down():
            return np.empty(0, dtype=np.int64)
        return self._missed.take(table)

    def _run_script(
        self,
        table: str,
        layout: _TableLayout,
        script: Script,
        parts: list[int],
        bounds: np.ndarray,
        args: np.ndarray,
        args_per_key: int,
    ) -> list[Any]:
        """Call ``script`` once per partition run, its keys' RESP ``args`` rows as ARGV; returns the replies."""
        head = script.evalsha_head()
        commands = [
            (
                layout.slots[p],
                [b"*%d\r\n" % (args_per_key * (e - s) + 4), head, layout.hashes_resp[p], args[s:e]],
            )
            for p, s, e in zip(parts, bounds[:-1], bounds[1:])
        ]
        return self._nodes.execute_script(table, script, commands, np.diff(bounds))

    @staticmethod
    def _flags(results: list[Any], bounds: np.ndarray, n: int) -> np.ndarray:
        """The '1'/'0' replies of per-partition script calls as one bool mask in sorted order (failed: False)."""
        mask = np.zeros(n, dtype=bool)
        for res, s, e in zip(results, bounds[:-1], bounds[1:]):
            if isinstance(res, bytes):
                mask[s:e] = np.frombuffer(res, dtype=np.uint8) == ord("1")
        return mask

    @staticmethod
    def _meta_key(table: str) -> bytes:
        return f"hps:meta:{{{table}}}".encode()

    def _layout(self, table: str, dim: int) -> _TableLayout:
        hashes = [f"hps:{{{table}:{p}}}".encode() for p in range(self._partitions)]
        return _TableLayout(
            dim=dim,
            hashes=hashes,
            slots=[key_slot(h) for h in hashes],
            hashes_resp=[b"$%d\r\n%s\r\n" % (len(h), h) for h in hashes],
        )

    def _table(self, table: str) -> _TableLayout:
        layout = self._tables.get(table)
        if layout is not None:
            return layout
        _check_table_name(table)
        try:
            stored = self._rc.get(self._meta_key(table))
        except RedisError as e:
            raise UnavailableError(
                f"table {table!r} is not known locally and its meta key is unreachable: {e}"
            ) from e
        if stored is None:
            raise NotFoundError(f"table {table!r} does not exist in the redis_cluster tier")
        layout = self._layout(table, int(stored))
        self._tables[table] = layout
        return layout

    def _group(self, keys: np.ndarray) -> tuple[np.ndarray, list[int], np.ndarray]:
        """Sort keys by partition: (order, partition of each run, run bounds into the sorted order)."""
        part = keys % self._partitions
        order = np.argsort(part, kind="stable")
        sorted_part = part[order]
        starts = np.flatnonzero(np.r_[True, sorted_part[1:] != sorted_part[:-1]])
        bounds = np.r_[starts, keys.size]
        return order, sorted_part[starts].tolist(), bounds
