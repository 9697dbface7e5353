"""The plain Redis Cluster baseline: rows stored as raw float32 values under hash-tagged keys, one tag per
master, so a batch costs one MGET per node; every node's MGET is sent before any answer is read.

This is the fastest layout measured for a plain client (``mget_nonatomic`` sends one command per slot and is
several times slower); the benchmark compares our served keys/s with it. ``loaded_cluster`` starts a real cluster
holding a table's rows for a benchmark round.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import redis
import redis.asyncio
import redis.connection
from redis.crc import key_slot

from hps_service.errors import InvalidArgumentError
from loadtest.harness.drivers import BAD_RESPONSE, CLIENT_ERROR, CallResult

if TYPE_CHECKING:
    from rich.console import Console

#: Key/value pairs per MSET while loading.
LOAD_CHUNK = 20_000


@dataclass(frozen=True)
class ClusterLayout:
    """Masters (``host:port``) and, per master, a hash tag whose slot it serves."""

    nodes: list[str]
    tags: list[bytes]

    def node_of(self, keys: np.ndarray) -> np.ndarray:
        """The master index that holds each key."""
        return (keys.view(np.uint64) % np.uint64(len(self.nodes))).astype(np.int64)

    def names(self, keys: np.ndarray, node: int) -> list[bytes]:
        """Redis key names of ``keys`` on master ``node``: its tag followed by the 8-byte big-endian key."""
        tag = self.tags[node]
        rec = np.empty(keys.shape[0], dtype=[("tag", f"V{len(tag)}"), ("key", "V8")])
        rec["tag"] = np.frombuffer(tag, dtype=f"V{len(tag)}")[0]
        rec["key"] = keys.astype(">i8").view("V8")
        return rec.view(f"V{len(tag) + 8}").tolist()


def cluster_layout(seed_node: str) -> ClusterLayout:
    """Read the masters and their slot ranges from ``seed_node`` and pick one hash tag per master."""
    host, _, port = seed_node.rpartition(":")
    with redis.Redis(host=host, port=int(port), socket_timeout=5) as client:
        slots = client.execute_command("CLUSTER", "SLOTS")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for entry in slots:
        start, end, master = int(entry[0]), int(entry[1]), entry[2]
        h = (master[0].decode() if isinstance(master[0], bytes) else str(master[0])) or host  # "" alone: its seed
        ranges.setdefault(f"{h}:{int(master[1])}", []).append((start, end))
    nodes = sorted(ranges)
    tags = []
    for node in nodes:
        i = 0
        while not any(lo <= key_slot(b"{%d}" % i) <= hi for lo, hi in ranges[node]):
            i += 1
        tags.append(b"{%d}" % i)
    return ClusterLayout(nodes=nodes, tags=tags)


def load_rows(layout: ClusterLayout, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Store every row (raw float32 bytes) on its master with pipelined MSETs."""
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    node = layout.node_of(keys)
    for n, address in enumerate(layout.nodes):
        idx = np.flatnonzero(node == n)
        host, _, port = address.rpartition(":")
        with redis.Redis(host=host, port=int(port), socket_timeout=30) as client:
            pipe = client.pipeline(transaction=False)
            for start in range(0, idx.shape[0], LOAD_CHUNK):
                chunk = idx[start : start + LOAD_CHUNK]
                names = layout.names(keys[chunk], n)
                values = vectors[chunk].view(f"V{vectors.shape[1] * 4}").ravel().tolist()
                flat: list[bytes] = [None] * (2 * len(names))  # type: ignore[list-item]
                flat[0::2], flat[1::2] = names, values
                pipe.execute_command("MSET", *flat)
            pipe.execute()


@dataclass
class _Batch:
    commands: list[tuple[int, bytes]]  # (master, its MGET packed as RESP) for each master the batch touches
    order: np.ndarray  # request positions in master-concatenated order


@dataclass
class RedisMgetDriver:
    """One MGET per master per batch, all sent before reading; rows decoded into one (n, dim) array in the
    order asked. Each call borrows its own set of connections (one per master). The MGETs are packed as RESP
    before the run, as the gRPC requests are serialised before it, so neither side pays encoding on the clock."""

    layout: ClusterLayout
    pool: np.ndarray  # (batches, batch) int64
    dim: int
    timeout_s: float = 10.0
    _batches: list[_Batch] = field(default_factory=list, init=False)
    _idle: list[list[redis.asyncio.Connection]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        packer = redis.connection.PythonRespSerializer(8192, lambda v: v)
        for keys in self.pool:
            node = self.layout.node_of(keys)
            order = np.argsort(node, kind="stable")
            commands = []
            for n in range(len(self.layout.nodes)):
                names = self.layout.names(keys[node == n], n)
                if names:
                    commands.append((n, b"".join(packer.pack("MGET", *names))))
            self._batches.append(_Batch(commands=commands, order=order))

    async def _connections(self) -> list[redis.asyncio.Connection]:
        if self._idle:
            return self._idle.pop()
        conns = []
        for address in self.layout.nodes:
            host, _, port = address.rpartition(":")
            conn = redis.asyncio.Connection(host=host, port=int(port), socket_timeout=self.timeout_s)
            await conn.connect()
            conns.append(conn)
        return conns

    async def open(self) -> None:
        self._idle.append(await self._connections())

    async def rows(self, i: int) -> np.ndarray:
        """Rows of batch ``i`` (modulo the pool) as ``(n, dim)`` float32 in request order.

        Redis and socket errors propagate; a key that is not stored or a value of the wrong size raises ValueError."""
        batch = self._batches[i % len(self._batches)]
        conns = await self._connections()
        try:
            for n, command in batch.commands:
                await conns[n].send_packed_command(command, check_health=False)
            values: list[bytes | None] = []
            for n, _ in batch.commands:
                values.extend(await conns[n].read_response())
        except BaseException:
            for conn in conns:
                await conn.disconnect()
            raise
        self._idle.append(conns)
        if any(v is None for v in values):
            raise ValueError(f"batch {i}: {values.count(None)} keys are not stored")
        rows = np.frombuffer(b"".join(values), dtype="<f4").reshape(len(values), self.dim)  # type: ignore[arg-type]
        out = np.empty_like(rows)
        out[batch.order] = rows
        return out

    async def call(self, i: int) -> CallResult:
        try:
            out = await self.rows(i)
        except (TimeoutError, redis.RedisError, OSError):
            return CallResult(CLIENT_ERROR, 0)
        except ValueError:  # a key that is not stored or a value of the wrong size
            return CallResult(BAD_RESPONSE, 0)
        return CallResult(0, out.shape[0])

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conns in idle:
            for conn in conns:
                await conn.disconnect()


def validate_single_table(tables: list[str]) -> None:
    """The Redis baseline stores one table."""
    if len(tables) != 1:
        raise InvalidArgumentError(f"the Redis baseline serves exactly one table, got {len(tables)}")


class NoRedis:
    """Stands in for the cluster when redis-server is not installed: enters as no seed node, no processes."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __enter__(self) -> None:
        return None

    def pids(self) -> list[int]:
        return []

    def __exit__(self, *exc: object) -> None:
        return None


class LoadedCluster:
    """A real cluster of ``masters`` masters (tests.fixtures.redis_cluster) holding every row of the keys file."""

    def __init__(self, keys_file: Path, workdir: Path, console: Console, masters: int = 3) -> None:
        self.keys_file, self.workdir, self.console = keys_file, workdir / "redis", console
        self.masters = masters
        self.cluster = None

    def __enter__(self) -> str:
        from tests.fixtures.redis_cluster import start_redis_cluster

        self.workdir.mkdir(exist_ok=True)
        self.cluster = start_redis_cluster(self.workdir, self.masters)
        t0 = time.perf_counter()
        with np.load(self.keys_file) as archive:
            keys, vectors = archive["keys"], archive["vectors"]
        load_rows(cluster_layout(self.cluster.nodes[0]), keys, vectors)
        self.console.print(f"  Redis Cluster on {', '.join(self.cluster.nodes)}: {keys.shape[0]} rows loaded in "
                           f"{time.perf_counter() - t0:.1f} s")
        return self.cluster.nodes[0]

    def pids(self) -> list[int]:
        """The redis-server processes (their CPU is the baseline's server-side cost)."""
        return [proc.pid for proc in self.cluster.processes if proc is not None] if self.cluster else []

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def loaded_cluster(keys_file: Path, workdir: Path, console: Console, masters: int = 3) -> LoadedCluster | NoRedis:
    """A cluster of ``masters`` masters holding the rows of ``keys_file``, or ``NoRedis`` (said on the console)
    when redis-server or redis-cli is not on PATH."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        reason = "redis-server/redis-cli not on PATH (make test-deps installs them): Redis baseline skipped"
        console.print(f"  [yellow]{reason}[/]")
        return NoRedis(reason)
    return LoadedCluster(keys_file, workdir, console, masters)
