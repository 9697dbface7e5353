"""The owner's gRPC Unix domain socket appears with its final mode (issue 57: it was bound with the umask's bits,
0755, and given 0600 only after the server had started listening on it): a watcher told by the kernel (inotify) of
every name created or moved into the socket's directory, while `hps serve` starts, sees it 0600 from the first."""

from __future__ import annotations

import ctypes
import os
import select
import stat
import struct
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers import ServerProcess, free_port, write_config

IN_CREATE, IN_MOVED_TO = 0x100, 0x80
_EVENT = struct.Struct("iIII")


class DirectoryWatch(threading.Thread):
    """Records the mode of each entry named ``name`` the moment the kernel reports it created or moved into
    ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        super().__init__(daemon=True)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert self.libc.inotify_add_watch(self.fd, str(directory).encode(), IN_CREATE | IN_MOVED_TO) >= 0
        self.path = directory / name
        self.entry = name.encode()
        self.modes: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        poller = select.poll()  # not select(): a test process may hold more than 1024 descriptors by now
        poller.register(self.fd, select.POLLIN)
        while not self.done.is_set():
            if not poller.poll(50):
                continue
            data = os.read(self.fd, 65536)
            offset = 0
            while offset < len(data):
                _, _, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if name == self.entry:
                    try:
                        self.modes.append(os.stat(self.path).st_mode)
                    except FileNotFoundError:
                        pass

    def stop(self) -> None:
        self.done.set()
        self.join(5)
        os.close(self.fd)


def test_the_local_socket_is_created_with_its_final_mode(tmp_path: Path) -> None:
    sockets = tmp_path / "run"
    sockets.mkdir()
    grpc_port = free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": free_port(), "workers": 1, "grpc_workers": 2,
                   "uds_path": str(sockets / "grpc.sock")},
        "cache": {"backend": "numpy", "capacity": 64},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 4}]}],
    })
    watch = DirectoryWatch(sockets, "grpc.sock")
    watch.start()
    umask = os.umask(0)  # the server inherits a umask that would leave the socket open to anyone, were its bits left
    try:
        with ServerProcess(cfg, grpc_port):
            os.umask(umask)
            final = os.stat(sockets / "grpc.sock").st_mode
            with grpc.insecure_channel(f"unix:{sockets / 'grpc.sock'}") as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        os.umask(umask)
        watch.stop()
    assert stat.S_ISSOCK(final) and stat.S_IMODE(final) == 0o600, oct(final)
    assert watch.modes, "the watcher never saw the socket appear"
    assert all(stat.S_IMODE(mode) == 0o600 for mode in watch.modes), [oct(m) for m in watch.modes]
    assert sorted(p.name for p in sockets.iterdir()) == []  # no private directory left, the socket gone with the server
