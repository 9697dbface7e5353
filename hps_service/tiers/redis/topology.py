"""The cluster's nodes for the Redis Cluster tier: slot routing, one pipelined round trip per batch, back-off.

Every batch sends all its commands to all nodes before it reads any reply (one round trip for the whole batch).
A node that fails (refused, timeout, CLUSTERDOWN, MOVED) makes its keys fall through as misses; it is then skipped
for ``node_retry_after_s``, after which one caller probes it again with a fresh view of the cluster topology.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
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

from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.tiers.redis.scripts import Script

log = logging.getLogger(__name__)


class Failed:
    """Result placeholder of a command whose node failed or was skipped."""


FAILED = Failed()


@dataclass(slots=True)
class Counters:
    """Failure counters of one table (node batches that fell through, keys that fell through)."""

    node_failures: int = 0
    node_skips: int = 0
    failed_keys: int = 0


def parse_node(node: str) -> ClusterNode:
    """A ``host:port`` seed as a redis-py ClusterNode."""
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"redis node {node!r} is not host:port")
    return ClusterNode(host, int(port))


class ClusterNodes:
    """The primaries of one Redis Cluster: runs ``(slot, RESP pieces)`` commands and keeps each node's back-off.

    ``rc`` is the redis-py client, for single-key commands outside a batch (the tables' meta keys).
    """

    def __init__(
        self,
        nodes: list[str],
        password: str | None,
        socket_timeout_s: float,
        node_retry_after_s: float,
        **connection_options: Any,
    ) -> None:
        startup = [parse_node(n) for n in nodes]
        self._retry_after = node_retry_after_s
        try:
            self.rc = RedisCluster(
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
        self._counters: dict[str, Counters] = {}
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()

    def load_scripts(self, *scripts: Script) -> None:
        """SCRIPT LOAD each script on every node (best effort: EVALSHA falls back to EVAL)."""
        for script in scripts:
            try:
                self.rc.script_load(script.source)
            except RedisError as e:  # a node that misses it answers NOSCRIPT and the call falls back to EVAL
                log.warning("redis_cluster: script not loaded on every node: %s", e)

    def failure_stats(self, table: str) -> tuple[int, dict[str, float]]:
        """``(errors, extra)`` of ``table``: node batches that fell through (failed or skipped), and the detail."""
        with self._lock:
            c = self._counters.setdefault(table, Counters())
            errors = c.node_failures + c.node_skips
            extra: dict[str, float] = {
                "node_failures": int(c.node_failures),
                "node_skips": int(c.node_skips),
                "failed_keys": int(c.failed_keys),
                "nodes_down": len(self._down_until),
            }
        return errors, extra

    def any_down(self) -> bool:
        """Whether some node is in back-off now."""
        with self._lock:
            return bool(self._down_until)

    def healthy(self) -> bool:
        """True while at least one primary answers PING (a failed node only turns its keys into misses)."""
        for node in self.rc.get_primaries():
            try:
                if self.rc.get_redis_connection(node).ping():
                    return True
            except RedisError:
                continue
        return False

    def close(self) -> None:
        """Close every node connection pool."""
        self.rc.close()

    def execute(
        self, table: str, commands: list[tuple[int, list[Any]]], keys_per_command: np.ndarray | None
    ) -> list[Any]:
        """Run ``(slot, RESP pieces)`` commands: group by node, write to every node, then read every reply.

        Results are the replies, an exception instance for an error reply, or ``FAILED`` where the node failed.
        """
        results: list[Any] = [FAILED] * len(commands)
        slots_cache = self.rc.nodes_manager.slots_cache
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
            pool = self.rc.get_redis_connection(node).connection_pool
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
                        results[i] = FAILED
                failed_nodes.append((name, idxs))
            else:
                with self._lock:
                    self._down_until.pop(name, None)
        unrouted = [i for i, r in enumerate(results) if r is FAILED and commands[i][0] not in slots_cache]
        self._record(table, failed_nodes, skipped_nodes, unrouted, results, keys_per_command)
        if refresh or unrouted:
            self._refresh_topology()
        return results

    def execute_script(
        self,
        table: str,
        script: Script,
        commands: list[tuple[int, list[Any]]],
        keys_per_command: np.ndarray | None,
    ) -> list[Any]:
        """Run EVALSHA ``commands``; where a node lost its script cache (restarted), EVAL loads it again."""
        results = self.execute(table, commands, keys_per_command=keys_per_command)
        retry = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if retry:
            eval_head = script.eval_head()
            again = [(commands[i][0], [commands[i][1][0], eval_head, *commands[i][1][2:]]) for i in retry]
            counts = keys_per_command[retry] if keys_per_command is not None else None
            for i, res in zip(retry, self.execute(table, again, keys_per_command=counts)):
                results[i] = res
        return results

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
            self.rc.nodes_manager.initialize()
        except RedisError as e:
            log.warning("redis_cluster: topology refresh failed: %s", e)
        finally:
            self._refresh_lock.release()

    def _record(
        self,
        table: str,
        failed_nodes: list[tuple[str, list[int]]],
        skipped_nodes: list[list[int]],
        unrouted: list[int],
        results: list[Any],
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
            c = self._counters.setdefault(table, Counters())
            c.node_failures += len(failed_nodes) + (1 if unrouted or moved else 0)
            c.node_skips += len(skipped_nodes)
            c.failed_keys += lost_keys
            for name, _ in failed_nodes:
                self._down_until[name] = until
        for name, _ in failed_nodes:
            log.warning("redis_cluster: node %s failed; skipping it for %.1fs", name, self._retry_after)
