"""The shared L2 volatile tier on a Redis Cluster: partitioned hashes, pipelined per node, versioned writes.

Layout: table ``T`` is split into ``partitions`` hashes ``hps:{T:p}`` (``p = key mod partitions``); the hash tag
puts one partition in one slot, so one HMGET/script call serves every key of a partition. Fields are 8-byte
big-endian keys, values are ``codec`` rows (int64 LE version + float32 vector) or tombstones (the 8 version
bytes alone, left by a versioned delete). Each partition hash counts its tombstones in the field
``#tombstones`` (never an 8-byte key), so ``count`` excludes them. ``hps:meta:{T}`` holds the dim.

Tombstones carry no TTL (Redis 7.0 has no per-field expiry, and an expired tombstone would reopen the key to
replays): each is a field of 8 + 8 bytes plus the hash entry overhead, and it is replaced by the next newer
put of its key, removed by an unversioned delete, or by :meth:`RedisClusterTier.purge_tombstones`.

Every batch sends all its commands to all nodes before it reads any reply (one round trip for the whole batch).
A node that fails (refused, timeout, CLUSTERDOWN, MOVED) makes its keys fall through as misses; it is then skipped
for ``node_retry_after_s``, after which one caller probes it again with a fresh view of the cluster topology.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.keys import as_keys
from hps_service.tiers import base, codec
from hps_service.tiers.base import MissedWrites, Rows, Tier, TierStats, delete_versions, max_version_per_key

log = logging.getLogger(__name__)

#: Shared head of the scripts: ``cmp`` orders two versions (the first 8 bytes, int64 little-endian, of a row
#: or tombstone) byte-wise from the most significant byte with the sign bit flipped, so negatives and values
#: beyond 2^53 compare exactly; ``count_tombstones`` adjusts the partition's ``#tombstones`` field.
_LUA_HEAD = """
local function cmp(stored, offered)
  for i = 8, 1, -1 do
    local a = string.byte(stored, i)
    local b = string.byte(offered, i)
    if i == 8 then a = (a + 128) % 256; b = (b + 128) % 256 end
    if a ~= b then if a < b then return -1 else return 1 end end
  end
  return 0
end
local function count_tombstones(h, delta)
  if delta ~= 0 and redis.call('HINCRBY', h, '#tombstones', delta) <= 0 then
    redis.call('HDEL', h, '#tombstones')
  end
end
local h = KEYS[1]
local out = {}
"""

#: Writes each offered row unless the stored row has a newer version or a tombstone is at or above the offered
#: one; returns one '1'/'0' per field.
_PUT_IF_NOT_OLDER_LUA = (
    _LUA_HEAD
    + """
local revived = 0
for i = 1, #ARGV, 2 do
  local cur = redis.call('HGET', h, ARGV[i])
  local ok = (not cur) or #cur < 8
  if not ok then
    local order = cmp(cur, ARGV[i + 1])
    if #cur == 8 then ok = order < 0 else ok = order <= 0 end
  end
  if ok then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    if cur and #cur == 8 then revived = revived + 1 end
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
count_tombstones(h, -revived)
return table.concat(out)
"""
)

#: Versioned delete: (field, 8-byte version) pairs. A row not newer than the delete, or an absent key, becomes
#: a tombstone at the delete's version; an older tombstone is raised. Returns '1' per live row removed, else '0'.
_DELETE_VERSIONED_LUA = (
    _LUA_HEAD
    + """
local added = 0
for i = 1, #ARGV, 2 do
  local cur = redis.call('HGET', h, ARGV[i])
  if (not cur) or #cur < 8 then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    added = added + 1
    out[#out + 1] = '0'
  elseif #cur == 8 then
    if cmp(cur, ARGV[i + 1]) < 0 then redis.call('HSET', h, ARGV[i], ARGV[i + 1]) end
    out[#out + 1] = '0'
  elseif cmp(cur, ARGV[i + 1]) <= 0 then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    added = added + 1
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
count_tombstones(h, added)
return table.concat(out)
"""
)

#: Unversioned delete: removes rows and tombstones of the given fields; returns the number of live rows removed.
_DELETE_LUA = (
    _LUA_HEAD
    + """
local live, tombstones = 0, 0
for i = 1, #ARGV do
  local cur = redis.call('HGET', h, ARGV[i])
  if cur then
    redis.call('HDEL', h, ARGV[i])
    if #cur == 8 then tombstones = tombstones + 1 else live = live + 1 end
  end
end
count_tombstones(h, -tombstones)
return live
"""
)

#: Removes the partition's tombstones older than ARGV[1] (8-byte version) among the fields of one HSCAN page
#: (ARGV[2] = cursor, ARGV[3] = page size); returns {next cursor, tombstones removed}.
_PURGE_LUA = (
    _LUA_HEAD
    + """
local page = redis.call('HSCAN', h, ARGV[2], 'COUNT', ARGV[3])
local fields = page[2]
local purged = 0
for i = 1, #fields, 2 do
  local v = fields[i + 1]
  if #fields[i] == 8 and #v == 8 and cmp(v, ARGV[1]) < 0 then
    redis.call('HDEL', h, fields[i])
    purged = purged + 1
  end
end
count_tombstones(h, -purged)
return {page[1], purged}
"""
)
_TOMBSTONE_COUNT_FIELD = b"#tombstones"


@dataclass(frozen=True, slots=True)
class _Script:
    """A Lua script and its SHA1, for EVALSHA with an EVAL fallback."""

    source: bytes
    sha: bytes

    @classmethod
    def of(cls, source: str) -> _Script:
        return cls(source.encode(), hashlib.sha1(source.encode()).hexdigest().encode())


class _Failed:
    """Result placeholder of a command whose node failed or was skipped."""


_FAILED = _Failed()
_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)


@dataclass(slots=True)
class _TableLayout:
    """Where a table's partitions live: hash names and their cluster slots."""

    dim: int
    hashes: list[bytes]
    slots: list[int]
    hashes_resp: list[bytes]  # each hash name as a RESP bulk string


@dataclass(slots=True)
class _Counters:
    """Failure counters of one table (node batches that fell through, keys that fell through)."""

    node_failures: int = 0
    node_skips: int = 0
    failed_keys: int = 0


def _parse_node(node: str) -> ClusterNode:
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"redis node {node!r} is not host:port")
    return ClusterNode(host, int(port))


def _check_table_name(table: str) -> None:
    if not table or "{" in table or "}" in table:
        raise InvalidArgumentError(f"table name {table!r} must be non-empty and contain no braces")


def _resp_command(*args: bytes) -> bytes:
    """One small command in the Redis wire protocol (RESP)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _resp_bulk_columns(n: int, *columns: np.ndarray) -> np.ndarray:
    """Per row, each ``(n, width)`` uint8 column as a RESP bulk string: one ``(n, total)`` uint8 array, no Python loop."""
    pieces = []
    for col in columns:
        head = np.frombuffer(b"$%d\r\n" % col.shape[1], dtype=np.uint8)
        pieces += [np.broadcast_to(head, (n, head.size)), col, np.broadcast_to(_CRLF, (n, 2))]
    return np.concatenate(pieces, axis=1)


def _key_bytes(keys: np.ndarray) -> np.ndarray:
    """Keys as ``codec.encode_keys`` stores them (8-byte big-endian), as an ``(n, 8)`` uint8 array."""
    return np.ascontiguousarray(keys, dtype=">i8").view(np.uint8).reshape(-1, 8)


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
        startup = [_parse_node(n) for n in nodes]
        self._partitions = partitions
        self._retry_after = node_retry_after_s
        try:
            self._rc = RedisCluster(
                startup_nodes=startup,
                password=password,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                require_full_coverage=False,
                retry=Retry(NoBackoff(), 1),
                decode_responses=False,
                **connection_options,
            )
        except RedisError as e:
            raise UnavailableError(f"cannot reach the Redis Cluster at {nodes}: {e}") from e
        self._put_script = _Script.of(_PUT_IF_NOT_OLDER_LUA)
        self._delete_versioned_script = _Script.of(_DELETE_VERSIONED_LUA)
        self._delete_script = _Script.of(_DELETE_LUA)
        self._purge_script = _Script.of(_PURGE_LUA)
        for script in (
            self._put_script,
            self._delete_versioned_script,
            self._delete_script,
            self._purge_script,
        ):
            try:
                self._rc.script_load(script.source)
            except RedisError as e:  # a node that misses it answers NOSCRIPT and the call falls back to EVAL
                log.warning("redis_cluster: script not loaded on every node: %s", e)
        self._tables: dict[str, _TableLayout] = {}
        self._counters: dict[str, _Counters] = {}
        self._down_until: dict[str, float] = {}
        #: Keys whose put/delete could not reach their node: they may hold stale rows once the node is back.
        self._missed = MissedWrites("redis_cluster")
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()

    # ------------------------------------------------------------------ tables

    def create_table(self, table: str, dim: int) -> None:
        """Record ``dim`` in the table's meta key (or check it against the stored one)."""
        _check_table_name(table)
        if dim <= 0:
            raise InvalidArgumentError(f"dim of table {table!r} must be positive, got {dim}")
        try:
            self._rc.set(self._meta_key(table), str(dim).encode(), nx=True)
            stored = int(self._rc.get(self._meta_key(table)))
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
        commands = [(slot, [_resp_command(b"DEL", h)]) for h, slot in zip(layout.hashes, layout.slots)]
        results = self._execute(table, commands, keys_per_command=None)
        failed = sum(isinstance(r, (_Failed, Exception)) for r in results)
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
        fields = _resp_bulk_columns(n, _key_bytes(keys[order]))
        commands = [
            (layout.slots[p], [b"*%d\r\n$5\r\nHMGET\r\n" % (e - s + 2), layout.hashes_resp[p], fields[s:e]])
            for p, s, e in zip(parts, bounds[:-1], bounds[1:])
        ]
        results = self._execute(table, commands, keys_per_command=np.diff(bounds))
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
        field_values = _resp_bulk_columns(
            n, _key_bytes(keys[order]), records.view(np.uint8).reshape(n, records.dtype.itemsize)
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
            fields = _resp_bulk_columns(keys.size, _key_bytes(keys[order]))
            results = self._run_script(table, layout, self._delete_script, parts, bounds, fields, 1)
            self._note_missed(table, results, bounds, keys[order])
            return sum(r for r in results if isinstance(r, int))
        keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        order, parts, bounds = self._group(keys)
        tombstones = np.ascontiguousarray(tomb_versions[order], dtype="<i8").view(np.uint8).reshape(-1, 8)
        field_values = _resp_bulk_columns(keys.size, _key_bytes(keys[order]), tombstones)
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
                    [b"*7\r\n", self._evalsha_head(self._purge_script), layout.hashes_resp[p], version_resp,
                     b"$%d\r\n%s\r\n" % (len(cursors[p]), cursors[p]), page_resp],
                )
                for p in parts
            ]  # fmt: skip
            results = self._retry_noscript(table, self._purge_script, commands, None)
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
        lengths = [(slot, [_resp_command(b"HLEN", h)]) for h, slot in zip(layout.hashes, layout.slots)]
        counters = [
            (slot, [_resp_command(b"HGET", h, _TOMBSTONE_COUNT_FIELD)])
            for h, slot in zip(layout.hashes, layout.slots)
        ]
        results = self._execute(table, lengths + counters, keys_per_command=None)
        total = 0
        for fields, tombstones in zip(results[: len(lengths)], results[len(lengths) :]):
            if isinstance(fields, int) and not isinstance(tombstones, (_Failed, Exception)):
                total += fields - (1 + int(tombstones) if tombstones is not None else 0)
        return total

    def tombstones(self, table: str) -> int:
        """Tombstones held on the reachable nodes (the partitions' ``#tombstones`` counters)."""
        layout = self._table(table)
        commands = [
            (slot, [_resp_command(b"HGET", h, _TOMBSTONE_COUNT_FIELD)])
            for h, slot in zip(layout.hashes, layout.slots)
        ]
        results = self._execute(table, commands, keys_per_command=None)
        return sum(int(r) for r in results if isinstance(r, bytes))

    def stats(self, table: str) -> TierStats:
        """Rows (reachable nodes), no capacity bound; errors = node batches that fell through (failed or skipped)."""
        with self._lock:
            c = self._counters.setdefault(table, _Counters())
            errors = c.node_failures + c.node_skips
            extra = {
                "node_failures": float(c.node_failures),
                "node_skips": float(c.node_skips),
                "failed_keys": float(c.failed_keys),
                "nodes_down": float(len(self._down_until)),
            }
        return TierStats(rows=self.count(table), capacity=None, errors=errors, extra=extra)

    def healthy(self) -> bool:
        """True while at least one primary answers PING (a failed node only turns its keys into misses)."""
        for node in self._rc.get_primaries():
            try:
                if self._rc.get_redis_connection(node).ping():
                    return True
            except RedisError:
                continue
        return False

    def close(self) -> None:
        """Close every node connection pool."""
        self._rc.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _evalsha_head(script: _Script) -> bytes:
        """``EVALSHA <sha> 1`` as RESP bulk strings (the array header and the key follow per command)."""
        return b"$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % script.sha

    def _note_missed(self, table: str, results: list, bounds: np.ndarray, sorted_keys: np.ndarray) -> None:
        """Remember the keys of partition writes that failed or were skipped."""
        bad = [i for i, r in enumerate(results) if not isinstance(r, (bytes, int, list))]
        if not bad:
            return
        self._missed.add(table, np.concatenate([sorted_keys[bounds[i] : bounds[i + 1]] for i in bad]))

    def take_missed_writes(self, table: str) -> np.ndarray:
        """Keys whose writes missed a node, handed over once every node answers again (none while one is down)."""
        with self._lock:
            if self._down_until:
                return np.empty(0, dtype=np.int64)
        return self._missed.take(table)

    def _run_script(
        self,
        table: str,
        layout: _TableLayout,
        script: _Script,
        parts: list[int],
        bounds: np.ndarray,
        args: np.ndarray,
        args_per_key: int,
    ) -> list:
        """Call ``script`` once per partition run, its keys' RESP ``args`` rows as ARGV; returns the replies."""
        head = self._evalsha_head(script)
        commands = [
            (
                layout.slots[p],
                [b"*%d\r\n" % (args_per_key * (e - s) + 4), head, layout.hashes_resp[p], args[s:e]],
            )
            for p, s, e in zip(parts, bounds[:-1], bounds[1:])
        ]
        return self._retry_noscript(table, script, commands, np.diff(bounds))

    def _retry_noscript(
        self,
        table: str,
        script: _Script,
        commands: list[tuple[int, list]],
        keys_per_command: np.ndarray | None,
    ) -> list:
        """Run EVALSHA ``commands``; where a node lost its script cache (restarted), EVAL loads it again."""
        results = self._execute(table, commands, keys_per_command=keys_per_command)
        retry = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if retry:
            eval_head = b"$4\r\nEVAL\r\n$%d\r\n%s\r\n$1\r\n1\r\n" % (len(script.source), script.source)
            again = [(commands[i][0], [commands[i][1][0], eval_head, *commands[i][1][2:]]) for i in retry]
            counts = keys_per_command[retry] if keys_per_command is not None else None
            for i, res in zip(retry, self._execute(table, again, keys_per_command=counts)):
                results[i] = res
        return results

    @staticmethod
    def _flags(results: list, bounds: np.ndarray, n: int) -> np.ndarray:
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

    def _claim(self, name: str, now: float) -> bool:
        """Whether a node may be used now; after its back-off one caller claims the probe, the others keep skipping."""
        with self._lock:
            until = self._down_until.get(name)
            if until is None:
                return True
            if now < until:
                return False
            self._down_until[name] = now + self._retry_after
        self._refresh_topology()
        return True

    def _refresh_topology(self) -> None:
        """Re-read slots -> nodes from the cluster (a restarted or promoted node is used again)."""
        if not self._refresh_lock.acquire(blocking=False):
            return
        try:
            self._rc.nodes_manager.initialize()
        except RedisError as e:
            log.warning("redis_cluster: topology refresh failed: %s", e)
        finally:
            self._refresh_lock.release()

    def _execute(
        self, table: str, commands: list[tuple[int, list]], keys_per_command: np.ndarray | None
    ) -> list:
        """Run ``(slot, RESP pieces)`` commands: group by node, write to every node, then read every reply.

        Results are the replies, an exception instance for an error reply, or ``_FAILED`` where the node failed.
        """
        results: list = [_FAILED] * len(commands)
        slots_cache = self._rc.nodes_manager.slots_cache
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, (slot, _) in enumerate(commands):
            owners = slots_cache.get(slot)
            if not owners:
                continue
            node = owners[0]
            by_node.setdefault(node.name, (node, []))[1].append(i)
        now = time.monotonic()
        failed_nodes: list[tuple[str, list[int]]] = []
        skipped_nodes: list[list[int]] = []
        in_flight = []
        for name, (node, idxs) in by_node.items():
            if not self._claim(name, now):
                skipped_nodes.append(idxs)
                continue
            pool = self._rc.get_redis_connection(node).connection_pool
            conn = None
            try:
                conn = pool.get_connection()
                conn.send_packed_command([b"".join([piece for i in idxs for piece in commands[i][1]])])
                in_flight.append((name, pool, conn, idxs))
            except (RedisError, OSError):
                if conn is not None:
                    conn.disconnect()
                    pool.release(conn)
                failed_nodes.append((name, idxs))
        refresh = False
        for name, pool, conn, idxs in in_flight:
            node_failed = False
            try:
                for i in idxs:
                    try:
                        results[i] = conn.read_response()
                    except ResponseError as e:
                        results[i] = e
                        if isinstance(e, (MovedError, AskError)):
                            refresh = True
                        node_failed |= isinstance(e, (ClusterDownError, TryAgainError))
            except (RedisError, OSError):
                conn.disconnect()
                node_failed = True
            finally:
                pool.release(conn)
            if node_failed:
                for i in idxs:
                    if not isinstance(results[i], (list, bytes, int)):
                        results[i] = _FAILED
                failed_nodes.append((name, idxs))
            else:
                with self._lock:
                    self._down_until.pop(name, None)
        unrouted = [i for i, r in enumerate(results) if r is _FAILED and commands[i][0] not in slots_cache]
        self._record(table, failed_nodes, skipped_nodes, unrouted, results, keys_per_command)
        if refresh or unrouted:
            self._refresh_topology()
        return results

    def _record(
        self,
        table: str,
        failed_nodes: list[tuple[str, list[int]]],
        skipped_nodes: list[list[int]],
        unrouted: list[int],
        results: list,
        keys_per_command: np.ndarray | None,
    ) -> None:
        """Count what fell through and put failed nodes in back-off."""
        moved = [i for i, r in enumerate(results) if isinstance(r, (MovedError, AskError))]
        if not (failed_nodes or skipped_nodes or unrouted or moved):
            return
        lost = [i for _, idxs in failed_nodes for i in idxs] + [i for idxs in skipped_nodes for i in idxs]
        lost += unrouted + moved
        lost_keys = int(np.sum(keys_per_command[lost])) if keys_per_command is not None else 0
        until = (
            time.monotonic() + self._retry_after
        )  # back-off counts from the failure, not the request start
        with self._lock:
            c = self._counters.setdefault(table, _Counters())
            c.node_failures += len(failed_nodes) + (1 if unrouted or moved else 0)
            c.node_skips += len(skipped_nodes)
            c.failed_keys += lost_keys
            for name, _ in failed_nodes:
                self._down_until[name] = until
        for name, _ in failed_nodes:
            log.warning("redis_cluster: node %s failed; skipping it for %.1fs", name, self._retry_after)
