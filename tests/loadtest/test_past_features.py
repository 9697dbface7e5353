"""Counting features from the past only: equal to a brute-force count over strictly earlier rows, ties unseen."""

from __future__ import annotations

import numpy as np

from loadtest.real_data.ml100k import dense_features
from loadtest.real_data.past_features import first_time, past_sums, previous_time


def _log(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 7, n).astype(str)
    time = np.sort(rng.integers(0, n // 3, n))  # many rows share a timestamp
    return keys, time, rng.random(n)


def test_past_sums_and_times_equal_a_brute_force_over_strictly_earlier_rows() -> None:
    keys, time, values = _log(400, seed=1)
    shuffle = np.random.default_rng(2).permutation(len(keys))  # the functions must not assume any order
    keys, time, values = keys[shuffle], time[shuffle], values[shuffle]
    earlier = (keys[None, :] == keys[:, None]) & (time[None, :] < time[:, None])  # [i, j]: j is before i
    np.testing.assert_allclose(past_sums(keys, time, values), (earlier * values[None, :]).sum(1), atol=1e-9)
    np.testing.assert_array_equal(past_sums(keys, time), earlier.sum(1))
    latest = np.where(earlier, time[None, :], -1).max(1)
    np.testing.assert_array_equal(previous_time(keys, time), latest)
    same_key = keys[None, :] == keys[:, None]
    np.testing.assert_array_equal(first_time(keys, time), np.where(same_key, time[None, :], time.max() + 1).min(1))


def _ratings(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rating = rng.integers(1, 6, n).astype(float)
    return {"timestamp": np.sort(rng.integers(0, 10 * n, n)) * 30, "rating": rating,
            "label": (rating >= 4).astype(np.int8), "C1": rng.integers(0, 20, n).astype(str),
            "C2": rng.integers(0, 30, n).astype(str), "C8": rng.choice(["Drama", "Comedy|Drama"], n)}


def test_a_sample_s_features_do_not_move_when_its_own_or_a_later_label_does() -> None:
    cols = _ratings(600, seed=3)
    base, frozen = dense_features(cols), dense_features(cols, frozen_after=400)
    changed = dict(cols)
    at = 300
    later = cols["timestamp"] >= cols["timestamp"][at]
    changed["rating"] = np.where(later, 6 - cols["rating"], cols["rating"])
    changed["label"] = (changed["rating"] >= 4).astype(np.int8)
    moved = dense_features(changed)
    for name in base:
        np.testing.assert_array_equal(moved[name][~later], base[name][~later], err_msg=name)
    assert any((moved[name][later] != base[name][later]).any() for name in ("I2", "I5", "I6"))
    # frozen at 400: the rows after see the first 400 only, whatever happens after the split
    changed = {**cols, "rating": np.r_[cols["rating"][:400], 6 - cols["rating"][400:]]}
    changed["label"] = (changed["rating"] >= 4).astype(np.int8)
    moved = dense_features(changed, frozen_after=400)
    for name in base:
        np.testing.assert_array_equal(moved[name], frozen[name], err_msg=name)
    np.testing.assert_array_equal(frozen["I4"][400:], (cols["C1"][:400][None, :] == cols["C1"][400:, None]).sum(1))
