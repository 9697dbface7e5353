"""A daemon thread that runs a loop until it is asked to stop (the shape of the server's periodic workers)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class BackgroundThread:
    """Runs ``target`` on a daemon thread named ``name``; ``target`` returns once :attr:`stopping` is set. ``nice``
    lowers the thread's CPU priority by that much (Linux schedules threads apart; the threads it starts inherit
    it), so bulk background work leaves the CPU to serving first."""

    def __init__(self, name: str, target: Callable[[], None], nice: int = 0) -> None:
        self.name = name
        self._target = target
        self.nice = nice
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:  # not Linux, or not allowed: the work runs at the process's priority
                pass
        self._target()

    def stop(self, timeout: float) -> None:
        """Ask the loop to stop and wait for it at most ``timeout`` seconds."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
