"""Helpers for the processes hps-service starts on this machine (demo, local broker, tests, benchmarks)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

#: Ports handed out lie in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``; a pair's second port, ``PAIR_OFFSET`` higher.
#: Both ranges sit below Linux's ephemeral range (32768 up), so no outgoing connection takes a port between the
#: moment it is picked and the moment its server binds it.
PORT_BASE, PORT_SPAN, PAIR_OFFSET = 12000, 10000, 10000
_cursor: dict[str, int] = {}


def port_slice() -> tuple[int, int]:
    """This process's share of the port range, ``(index, count)`` from ``HPS_PORT_SLICE=i/n`` (default 0/1):
    processes started side by side (the test workers) get disjoint slices and so never pick the same port."""
    raw = os.environ.get("HPS_PORT_SLICE", "0/1")
    try:
        index, count = (int(part) for part in raw.split("/"))
    except ValueError:
        raise ValueError(f"HPS_PORT_SLICE must be 'index/count', got {raw!r}") from None
    if not 0 <= index < count <= PORT_SPAN:
        raise ValueError(f"HPS_PORT_SLICE {raw!r}: need 0 <= index < count <= {PORT_SPAN}")
    return index, count


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(pair: bool = False) -> int:
    """A TCP port on 127.0.0.1 that is free now, from this process's slice, taken in turn from a random start (not
    handed out again until the slice wraps round); with ``pair``, ``port + PAIR_OFFSET`` is free too (Redis
    Cluster's bus and SeaweedFS bind both)."""
    index, count = port_slice()
    width = PORT_SPAN // count
    start = PORT_BASE + index * width
    key = f"{index}/{count}"
    if key not in _cursor:
        _cursor[key] = random.randrange(width)
    for _ in range(width):
        port = start + _cursor[key]
        _cursor[key] = (_cursor[key] + 1) % width
        if _bindable(port) and (not pair or _bindable(port + PAIR_OFFSET)):
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {start}..{start + width - 1} (HPS_PORT_SLICE {key})")


def stop_process(proc: subprocess.Popen[Any], timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` (a graceful stop), SIGKILL after ``timeout`` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (a node's owner, its fork server and workers) from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size of ``pids`` together (shared pages split among the processes that map them, so a
    node's shared store counts once); processes gone count 0."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total
