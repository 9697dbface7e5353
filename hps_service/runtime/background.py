"""A daemon thread that runs a loop until it is asked to stop (the shape of the server's periodic workers)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class BackgroundThread:
    """Runs ``target`` on a daemon thread named ``name``; ``target`` returns once :attr:`stopping` is set."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self.name = name
        self._target = target
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._target, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Ask the loop to stop and wait for it at most ``timeout`` seconds."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
