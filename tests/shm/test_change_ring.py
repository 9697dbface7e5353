"""A reader of the change ring whose window an append is overwriting (issue 27, defect 2): it must see a lap, never
"not written" for a key it can no longer read. Run deterministically at the seam: the reader runs between the
writer's copy of the keys into the ring and its advance of the position."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hps_service.shm.changes import ChangeRing


class _AfterCopy(np.ndarray):
    """The ring's key slots, running ``hook`` once right after the first slice of an append was copied in."""

    hook: Callable[[], None] | None = None

    def __setitem__(self, index, value) -> None:  # noqa: ANN001
        super().__setitem__(index, value)
        hook, type(self).hook = type(self).hook, None
        if hook is not None:
            hook()


def test_a_reader_between_the_copy_and_the_advance_of_a_large_append_sees_a_lap() -> None:
    size, window = 16_384, 10_000
    ring = ChangeRing(np.zeros(size, np.int64).view(_AfterCopy), np.zeros(4, np.int64), 0)
    for lo in range(0, 2 * size, size // 2):  # twice round: the next append starts at slot 0
        ring.append(np.arange(lo, lo + size // 2, dtype=np.int64) + 1)
    since = ring.position() - window
    victim = np.array([int(ring.keys[(since + 1000) % size])], np.int64)  # written 9000 keys ago
    assert ring.stale(since, victim)
    assert not ring.stale(since, np.array([-5], np.int64))  # a key never written

    seen: list[bool] = []
    _AfterCopy.hook = lambda: seen.append(ring.stale(since, victim))
    before = ring.position()
    ring.append(np.arange(-15_000, 0, dtype=np.int64))  # one copy over the oldest 15,000 slots, the victim's
    assert ring.position() == before + 15_000
    assert int(ring.keys[(since + 1000) % size]) != victim[0]  # the victim's slot was overwritten
    assert seen == [True], "a reader between the copy and the advance missed the key and the lap"
    assert ring.stale(since, victim)  # after the advance the window is lapped


def test_appends_that_do_not_reach_a_window_leave_its_answers_exact() -> None:
    """The reservation only marks what an append overwrites: a reader whose window is clear of it keeps exact
    answers (no needless catch-ups) during the copy."""
    size = 4096
    ring = ChangeRing(np.zeros(size, np.int64).view(_AfterCopy), np.zeros(4, np.int64), 0)
    ring.append(np.arange(1, 1001, dtype=np.int64))
    since = ring.position() - 500  # window: keys 501..1000
    seen: list[tuple[bool, bool]] = []
    _AfterCopy.hook = lambda: seen.append((ring.stale(since, np.array([700])), ring.stale(since, np.array([10]))))
    ring.append(np.arange(5000, 6000, dtype=np.int64))
    assert seen == [(True, False)]
