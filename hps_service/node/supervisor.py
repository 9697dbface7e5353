"""Starting, watching and stopping a node's gRPC worker processes (the owner's side).

Workers are forked from a fork server (``multiprocessing``'s ``forkserver``): a fresh interpreter started at the
beginning of ``hps serve``, which imports the worker's modules, loads the compiled kernels and freezes its heap
(:mod:`hps_service.serve.fork_preload`), then forks one worker per request. So every worker starts from a process with no
gRPC state and no threads (gRPC does not survive a fork of a process that used it), in milliseconds, and shares
the fork server's pages of code and compiled kernels instead of holding its own copy; restarting one later does
not fork the owner, whose threads (the consumer, RocksDB, the REST server) could hold locks at that moment.

A worker that dies is started again (after a back-off that doubles while it keeps dying right after starting); its
in-flight calls fail with UNAVAILABLE and clients retry them on another connection. A worker that dies right after
starting ``CRASH_LOOP_EXITS`` times in a row is not started again: it is marked failed, which the log, the metrics
and ``/readyz`` say, instead of spinning. Stopping sends SIGTERM (each worker drains its calls) and SIGKILL to what
is left after the grace period.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Any

from hps_service.config import HPSConfig
from hps_service.errors import UnavailableError
from hps_service.node.store import node_store as ns
from hps_service.runtime.sockets import bound_socket

log = logging.getLogger(__name__)
#: While workers start, a line this often saying how many are ready.
WAIT_PROGRESS_S = 5.0

#: A worker that exits within ``QUICK_EXIT_S`` of its start is restarted only after a back-off, ``RESTART_BACKOFF_S``
#: doubled for each such exit in a row, and not at all after ``CRASH_LOOP_EXITS`` of them (so a worker that cannot
#: start, or dies on what it reads at start, does not spin).
QUICK_EXIT_S, RESTART_BACKOFF_S, CRASH_LOOP_EXITS = 2.0, 0.5, 5


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT that holds the port for the node (0 picks a free one):
    the workers bind the same port beside it. It never listens, so it takes no connections.

    SO_REUSEPORT would also let this node join a port another server (another ``hps serve`` of this user) already
    serves, and the kernel would split the connections between the two; so the port is first bound without it,
    which fails while anything else holds it (SO_REUSEADDR only lets it past connections in TIME_WAIT)."""
    if port:
        bound_socket(host, port, "gRPC").close()
    return bound_socket(host, port, "gRPC", socket.SO_REUSEPORT)


@dataclass(frozen=True)
class WorkerProgram:
    """What a worker process runs: ``main(config, store_path, worker, port, wake, log_level)``, and the module the
    fork server imports (and warms) before it forks one. Given by the process that composes the node (``serve/``),
    so that the node does not import the gRPC front end it serves."""

    main: Callable[[HPSConfig, str, int, int, Any, int], None]
    preload: str


class WorkerSupervisor:
    """The owner's handle on its worker processes."""

    def __init__(self, config: HPSConfig, store: ns.NodeStore, wake: Any, log_level: int,
                 program: WorkerProgram) -> None:
        self.config = config
        self.program = program
        self.store = store
        self.wake = wake
        self.log_level = log_level
        self.count = config.server.worker_processes()
        self.port = 0
        self.restarts = 0
        self._ctx = multiprocessing.get_context("forkserver")
        self._procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self._started_at: dict[int, float] = {}
        self._quick_exits: dict[int, int] = {}  # worker -> exits right after its start, in a row
        #: Why a worker is not started again (worker -> reason), for the log, /readyz and /v1/stats.
        self.given_up: dict[int, str] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._nudge_r, self._nudge_w = os.pipe()

    @staticmethod
    def prepare(program: WorkerProgram) -> None:
        """Start the fork server now, so that it imports and warms up while the owner loads its tables."""
        forkserver.set_forkserver_preload([program.preload])
        forkserver.ensure_running()

    def start(self, port: int, timeout: float = 120.0) -> None:
        """Start every worker on ``port`` and wait until each has bound it; then watch them."""
        self.port = port
        for i in range(self.count):
            self._spawn(i)
        self.wait_ready(timeout)
        self._monitor = threading.Thread(target=self._watch, name="hps-workers", daemon=True)
        self._monitor.start()

    def _spawn(self, i: int) -> None:
        self.store.workers[i, ns.W_STATE] = ns.W_STARTING
        self.store.workers[i, ns.W_STARTS] += 1
        proc = self._ctx.Process(
            target=self.program.main, name=f"hps-worker-{i}", daemon=True,
            args=(self.config, str(self.store.path), i, self.port, self.wake, self.log_level),
        )
        proc.start()
        self.store.workers[i, ns.W_PID] = proc.pid
        with self._lock:
            self._procs[i] = proc
            self._started_at[i] = time.monotonic()

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker has bound the port (UnavailableError naming the first that failed)."""
        started = time.monotonic()
        deadline, say_at = started + timeout, started + WAIT_PROGRESS_S
        while True:
            states = self.store.workers[: self.count, ns.W_STATE]
            if (states == ns.W_READY).all():
                return
            if time.monotonic() > say_at:  # a fork server that compiles (an unwritable numba cache) is not silent
                say_at += WAIT_PROGRESS_S
                log.info("waiting for the gRPC worker processes: %d of %d ready, %.0f s so far",
                         int((states == ns.W_READY).sum()), self.count, time.monotonic() - started)
            for i in range(self.count):
                proc = self._procs[i]
                if states[i] == ns.W_FAILED or not proc.is_alive():
                    raise UnavailableError(f"gRPC worker {i} failed to start (exit code {proc.exitcode}); see the "
                                           f"log above")
            if time.monotonic() > deadline:
                raise UnavailableError(f"gRPC workers not ready within {timeout:.0f} s")
            time.sleep(0.01)

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs.values() if p.pid is not None and p.is_alive()]

    def _watch(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                procs = dict(self._procs)
            ready = multiprocessing.connection.wait([p.sentinel for p in procs.values()] + [self._nudge_r], 1.0)
            if self._stopping.is_set():
                return
            for i, proc in procs.items():
                if proc.sentinel in ready and self._restart(i, proc):
                    return

    def _restart(self, i: int, proc: multiprocessing.process.BaseProcess) -> bool:
        """Start worker ``i`` again after it exited (a back-off first when it died right after starting), or give it
        up when it crash-loops; True when the supervisor is stopping."""
        proc.join(0)
        lived = time.monotonic() - self._started_at.get(i, 0.0)
        quick = self._quick_exits[i] = self._quick_exits.get(i, 0) + 1 if lived < QUICK_EXIT_S else 0
        self.store.workers[i, ns.W_STATE] = ns.W_STOPPED
        if quick >= CRASH_LOOP_EXITS:
            self.given_up[i] = (f"gRPC worker {i} crash-loops ({quick} exits within {QUICK_EXIT_S:g} s of its start, "
                                f"the last with {proc.exitcode}) and is not started again; restart the server")
            self.store.workers[i, ns.W_STATE] = ns.W_FAILED
            with self._lock:
                del self._procs[i]
            log.error("%s", self.given_up[i])
            return False
        backoff = RESTART_BACKOFF_S * 2 ** (quick - 1) if quick else 0.0
        log.error("gRPC worker %d (pid %s) exited with %s after %.1f s; starting it again%s", i, proc.pid,
                  proc.exitcode, lived, f" in {backoff:g} s" if backoff else "")
        if backoff and self._stopping.wait(backoff):
            return True
        self.restarts += 1
        self._spawn(i)
        return False

    def not_serving(self) -> list[str]:
        """Why a worker does not serve now (empty when every one does): starting, restarting, or given up."""
        states = self.store.workers[: self.count, ns.W_STATE]
        return [self.given_up.get(i) or f"gRPC worker {i} is {'starting' if state == ns.W_STARTING else 'restarting'}"
                for i, state in enumerate(states.tolist()) if state != ns.W_READY]

    def stop(self, grace: float) -> None:
        """SIGTERM every worker (each drains its calls), SIGKILL those still running after ``grace`` seconds."""
        self._stopping.set()
        os.write(self._nudge_w, b"x")
        if self._monitor is not None:
            self._monitor.join(5)
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                log.warning("gRPC worker pid %s did not drain within %.1f s; killing it", p.pid, grace)
                p.kill()
                p.join(5)
        os.close(self._nudge_r)
        os.close(self._nudge_w)
