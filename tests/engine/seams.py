"""Seams for deterministic race tests: stop one side inside a window with events, never with sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: How long a test waits for a side to reach a seam or to finish (a bound on a hang, never a timing assertion).
PATIENCE_S = 30.0


class Pause:
    """Replaces ``obj.name`` with a wrapper that stops the first matching call inside it until :meth:`release`.

    ``after``: stop once the real call returned (its effect is done), else before it runs. ``when(*args)``
    picks the call (default: every call in a thread named ``thread``). ``reached`` is set when a call stopped.
    """

    def __init__(self, obj: Any, name: str, *, thread: str | None = None, after: bool = True,
                 when: Callable[..., bool] | None = None) -> None:
        self.obj, self.name = obj, name
        self.real = getattr(obj, name)
        self.reached = threading.Event()
        #: The arguments of the call that stopped.
        self.args: tuple = ()
        self._released = threading.Event()
        self._armed = True
        self._lock = threading.Lock()
        thread_name = thread

        def matches(*args: Any, **kwargs: Any) -> bool:
            if thread_name is not None and threading.current_thread().name != thread_name:
                return False
            return when is None or when(*args, **kwargs)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                stop = self._armed and matches(*args, **kwargs)
                if stop:
                    self._armed = False
                    self.args = args
            if stop and not after:
                self._stop()
            result = self.real(*args, **kwargs)
            if stop and after:
                self._stop()
            return result

        setattr(obj, name, wrapper)

    def _stop(self) -> None:
        self.reached.set()
        assert self._released.wait(PATIENCE_S), f"{self.name} was never released"

    def wait_reached(self) -> None:
        assert self.reached.wait(PATIENCE_S), f"no call reached the seam in {self.name}"

    def release(self) -> None:
        self._released.set()

    def restore(self) -> None:
        self._released.set()
        setattr(self.obj, self.name, self.real)


class Side(threading.Thread):
    """One side of a race, run in its own named thread; ``result``/``error`` once done."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001  (reported by the test through .error)
            self.error = exc
        finally:
            self.done.set()

    def finish(self) -> Any:
        assert self.done.wait(PATIENCE_S), f"{self.name} did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def finished_or_blocked(side: Side, grace_s: float = 2.0) -> bool:
    """Give ``side`` a chance to run to the end while the other side is paused: True if it finished.

    Without serialisation it finishes (and the race happens); with it, it stays blocked until the paused side
    is released, so this returns False after ``grace_s``. Only the order of events matters to the test's
    assertions, never this duration."""
    return side.done.wait(grace_s)


class Watch:
    """Replaces ``obj.name`` with a wrapper that sets ``called`` when the method is entered (it never stops it)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.called = threading.Event()
        real = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.called.set()
            return real(*args, **kwargs)

        setattr(obj, name, wrapper)

    def wait_called(self) -> None:
        assert self.called.wait(PATIENCE_S), "never called"
