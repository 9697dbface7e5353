"""The change log that keeps rows read before an update out of L1: bounded, and never wrong when it forgets."""

from __future__ import annotations

import numpy as np

from hps_service.cache.change_log import ChangeLog


def test_changed_since_names_the_keys_changed_after_a_generation() -> None:
    log = ChangeLog()
    log.record(np.array([1, 2]))
    before = log.generation
    log.record(np.array([3, -(2**63)]))
    changed = log.changed_since(before, np.array([1, 3, 4, -(2**63)]))
    assert changed is not None and changed.tolist() == [False, True, False, True]
    assert not log.changed_since(log.generation, np.array([3])).any()


def test_bounded_by_keys_held_and_forgetting_answers_none() -> None:
    log = ChangeLog(max_batches=1000, max_keys=100_000)
    start = log.generation
    for i in range(40):  # 40 import-sized chunks: 2.6M keys offered, at most ~100k kept
        log.record(np.arange(i * 65_536, (i + 1) * 65_536))
    assert log._held <= 100_000 + 65_536
    assert log.changed_since(start, np.array([0])) is None  # a read that old can no longer be proven fresh
    recent = log.generation - 1
    changed = log.changed_since(recent, np.array([39 * 65_536, 0]))
    assert changed is not None and changed.tolist() == [True, False]


def test_bounded_by_batches() -> None:
    log = ChangeLog(max_batches=3)
    start = log.generation
    for k in range(5):
        log.record(np.array([k]))
    assert log.changed_since(start, np.array([0])) is None
    assert log.changed_since(log.generation - 3, np.array([1, 2, 4])).tolist() == [False, True, True]
