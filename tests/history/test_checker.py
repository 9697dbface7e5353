"""The history checker on hand-made histories: it flags each kind of violation and accepts what concurrency allows."""

from __future__ import annotations

import numpy as np

from tests.history.model import DEFAULT, WRONG, History, Read, Write, check, check_tiers_agree, decode_rows, encode_rows


def put(h: History, version: int, start: float, ack: float | None, key: int = 7, via: str = "rest") -> None:
    h.add_write(Write("put", np.array([key]), version, start, via, ack))


def read(h: History, shown: int, start: float, end: float, key: int = 7) -> None:
    h.add_read(Read(np.array([key]), np.array([shown]), np.array([4 if shown == DEFAULT else 2]), start, end))


def rules(h: History) -> list[str]:
    return [v.rule for v in check(h)]


def test_rows_tell_their_write_and_a_wrong_row_is_caught() -> None:
    keys = np.array([5, -(2**63), 2**63 - 1])
    rows = encode_rows(keys, 123)
    sources = np.array([1, 2, 3])
    assert decode_rows(keys, rows, sources).tolist() == [123] * 3
    assert decode_rows(keys, rows[::-1].copy(), sources).tolist()[0] == WRONG  # another key's row
    defaults = np.full((3, 4), -1.0, np.float32)
    assert decode_rows(keys, defaults, np.array([4, 4, 1])).tolist() == [DEFAULT, DEFAULT, WRONG]


def test_stale_read_and_lost_update() -> None:
    h = History()
    put(h, 1, 0.0, 1.0)
    put(h, 2, 2.0, 3.0)
    read(h, 2, 4.0, 5.0)  # fine
    read(h, 1, 2.5, 3.5)  # v2 in flight: v1 is fine
    assert rules(h) == []
    read(h, 1, 4.0, 5.0)
    read(h, DEFAULT, 4.0, 5.0)
    assert rules(h) == ["stale read", "lost update"]


def test_deletes_versioned_and_admin() -> None:
    h = History()
    put(h, 1, 0.0, 1.0)
    h.add_write(Write("delete", np.array([7]), 2, 2.0, "kafka", 3.0))
    read(h, DEFAULT, 4.0, 5.0)
    read(h, 1, 2.5, 3.5)  # the delete in flight
    put(h, 3, 6.0, 7.0)
    h.add_write(Write("admin_delete", np.array([7]), None, 8.0, "rest", 9.0))
    read(h, DEFAULT, 10.0, 11.0)
    read(h, 3, 8.5, 8.6)  # the admin delete in flight
    assert rules(h) == []
    read(h, 1, 4.0, 5.0)  # deleted at v2
    read(h, 3, 10.0, 11.0)  # removed by the admin delete
    assert rules(h) == ["resurrected", "resurrected"]


def test_an_older_put_in_flight_may_land_after_an_admin_delete_forgot_the_tombstone() -> None:
    h = History()
    put(h, 1, 0.0, 9.5, via="kafka")  # in flight for long
    h.add_write(Write("delete", np.array([7]), 2, 2.0, "kafka", 3.0))
    h.add_write(Write("admin_delete", np.array([7]), None, 4.0, "rest", 5.0))
    read(h, 1, 10.0, 11.0)
    assert rules(h) == []


def test_phantom_and_wrong_rows() -> None:
    h = History()
    put(h, 5, 3.0, 4.0)
    read(h, 5, 1.0, 2.0)  # before the put began
    read(h, 9, 5.0, 6.0)  # no such write
    read(h, WRONG, 5.0, 6.0)
    assert rules(h) == ["phantom", "phantom", "wrong row"]


def test_tiers_agree() -> None:
    keys = np.array([1, 2, 3])
    stored = np.array([4, DEFAULT, 6])
    assert check_tiers_agree(keys, {"L1": np.array([4, DEFAULT, 6])}, stored) == []
    bad = check_tiers_agree(keys, {"L1": np.array([4, 5, 6]), "L2": np.array([3, DEFAULT, 6])}, stored)
    assert [(v.key, v.rule) for v in bad] == [(2, "tiers disagree"), (1, "tiers disagree")]


def test_an_older_put_may_land_after_an_admin_delete_that_may_follow_a_newer_put() -> None:
    h = History()
    put(h, 1, 0.0, 6.0, via="kafka")  # in flight until after the admin delete began
    h.add_write(Write("admin_delete", np.array([7]), None, 1.0, "rest", 3.0))
    put(h, 2, 2.0, 2.5)  # acknowledged while the admin delete ran: the delete may follow it
    read(h, 1, 7.0, 8.0)
    assert rules(h) == []
    put(h, 3, 9.0, 9.5)  # acknowledged after every delete ended: nothing excuses an older answer
    read(h, 1, 10.0, 11.0)
    assert rules(h) == ["stale read"]
