"""The sequence lock behind lock-free L1 lookups: an answer overlapped by a writer is never kept."""

from __future__ import annotations

import threading

import pytest

from hps_service.cache.seqlock import SeqLock

WAIT_S = 10.0


def test_read_without_writers_runs_once() -> None:
    lock = SeqLock()
    calls: list[int] = []
    assert lock.read(lambda x: calls.append(x) or x * 2, 21) == 42
    assert calls == [21]


def test_read_overlapped_by_a_writer_is_rerun_after_the_writer() -> None:
    lock = SeqLock()
    state = {"value": "old"}
    writer_in = threading.Event()
    writer_may_finish = threading.Event()
    seen: list[str] = []

    def writer() -> None:
        with lock.write():
            writer_in.set()
            state["value"] = "half-written"
            writer_may_finish.wait(WAIT_S)
            state["value"] = "new"

    def read_state() -> str:
        if not seen:  # the first attempt: a writer starts and changes the state under it
            threading.Thread(target=writer).start()
            assert writer_in.wait(WAIT_S)
            threading.Timer(0.05, writer_may_finish.set).start()
        seen.append(state["value"])
        return state["value"]

    assert lock.read(read_state) == "new"
    assert seen == ["half-written", "new"]
    assert lock.sequence % 2 == 0


def test_read_while_a_writer_holds_the_lock_waits_for_it() -> None:
    lock = SeqLock()
    state = {"value": 0}
    entered = threading.Event()
    release = threading.Event()

    def writer() -> None:
        with lock.write():
            entered.set()
            release.wait(WAIT_S)
            state["value"] = 1

    thread = threading.Thread(target=writer)
    thread.start()
    assert entered.wait(WAIT_S)
    threading.Timer(0.05, release.set).start()
    assert lock.read(lambda: state["value"]) == 1
    thread.join()


def test_exclusive_holds_off_writers() -> None:
    lock = SeqLock()
    order: list[str] = []
    def writer() -> None:
        with lock.write():
            order.append("writer")

    with lock.exclusive():
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join(0.1)
        order.append("reader")
    thread.join(WAIT_S)
    assert order == ["reader", "writer"]


def test_a_writer_preparing_its_change_under_exclusive_does_not_rerun_readers() -> None:
    """Only ``changing()`` makes readers rerun: a read that overlaps the preparation is kept, one that overlaps
    the change is not; ``changing()`` outside ``exclusive()`` is refused (it would let two writers in)."""
    lock = SeqLock()
    calls: list[int] = []
    with lock.exclusive():
        before = lock.sequence
        assert lock.read(lambda: calls.append(1) or 1) == 1  # overlaps the preparation: kept at once
        with lock.changing():
            assert lock.sequence == before + 1
        assert lock.sequence == before + 2
    assert calls == [1]
    with pytest.raises(RuntimeError, match="outside exclusive"), lock.changing():
        pass
    assert lock.sequence % 2 == 0
