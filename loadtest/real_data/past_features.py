"""Counting features of a time-ordered log computed from the past only, as a practitioner's feature pipeline would.

Every feature of a sample uses only samples strictly earlier in time: samples that share a timestamp do not see
each other (a log's order within one second is not information a server would have had). All functions are
vectorised over the whole log (a sort, cumulative sums and a scatter), never a loop per key.
"""

from __future__ import annotations

import numpy as np


def _groups(keys: np.ndarray, time: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order by key then time, first position of each row's key, first position of its (key, time) group)."""
    order = np.lexsort((time, keys))
    k, t = keys[order], time[order]
    n = len(order)
    at = np.arange(n)
    new_key = np.ones(n, dtype=bool)
    new_key[1:] = k[1:] != k[:-1]
    new_group = new_key.copy()
    new_group[1:] |= t[1:] != t[:-1]
    return order, np.maximum.accumulate(np.where(new_key, at, 0)), np.maximum.accumulate(np.where(new_group, at, 0))


def past_sums(keys: np.ndarray, time: np.ndarray, values: np.ndarray | None = None) -> np.ndarray:
    """For every row: the sum of ``values`` (default 1: a count) over strictly earlier rows with the same key."""
    order, key_first, group_first = _groups(np.asarray(keys), np.asarray(time))
    v = np.ones(len(order)) if values is None else np.asarray(values, dtype=np.float64)[order]
    before = np.concatenate(([0.0], np.cumsum(v)))  # before[i]: the sum of the sorted rows 0..i-1
    out = np.empty(len(order))
    out[order] = before[group_first] - before[key_first]
    return out


def previous_time(keys: np.ndarray, time: np.ndarray) -> np.ndarray:
    """For every row: the time of the key's latest strictly earlier row; -1 where the key has none."""
    time = np.asarray(time)
    order, key_first, group_first = _groups(np.asarray(keys), time)
    t = time[order]
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.where(group_first > key_first, t[np.maximum(group_first - 1, 0)], -1)
    return out


def first_time(keys: np.ndarray, time: np.ndarray) -> np.ndarray:
    """For every row: the time of the key's first row (its own time when none is earlier)."""
    time = np.asarray(time)
    order, key_first, _ = _groups(np.asarray(keys), time)
    out = np.empty(len(order), dtype=time.dtype)
    out[order] = time[order][key_first]
    return out
