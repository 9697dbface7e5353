"""A single-producer, single-consumer ring of records in shared memory: how a worker hands rows to the owner.

The producer (one worker process; its threads take a process-local lock) appends records and then advances
``tail``; the consumer (the owner) reads records up to ``tail`` and then advances ``head``. Both counters only
grow (a position is the counter modulo the ring size) and are advanced with sequentially consistent atomic adds,
which are full barriers: the bytes of a record are in place before ``tail`` says so, and they are read before
``head`` lets the producer overwrite them. A record never wraps: when it does not fit before the end, a padding
record fills the rest and it starts at 0 (in the last 8 bytes, a padding record is its length alone). A full ring refuses the record (the caller counts it as dropped), so a
slow owner never blocks a lookup.

Record: eight int64 header fields (``length, kind, table, n, dim, generation, hit_rate as float64 bits, 0``),
then ``n`` int64 keys, ``n`` int64 versions and ``n * dim`` float32 rows, padded to 8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from hps_service.jit.atomic import atomic_fetch_add, atomic_load

CTRL_HEAD, CTRL_TAIL = 0, 8
CTRL_LEN = 16
_HEADER = 8
KIND_PAD = 0


@numba.njit(cache=True, nogil=True)
def _advance(ctrl: np.ndarray, which: int, by: int) -> None:
    atomic_fetch_add(ctrl, which, by)


@numba.njit(cache=True, nogil=True)
def _load(ctrl: np.ndarray, which: int) -> np.int64:
    return atomic_load(ctrl, which)


@numba.njit(cache=True, nogil=True)
def _append(ctrl: np.ndarray, words: np.ndarray, floats: np.ndarray, kind: int, table: int, generation: int,
            hit_bits: np.int64, keys: np.ndarray, versions: np.ndarray, rows: np.ndarray) -> bool:
    # Ring.push in one compiled pass (header, keys, versions and rows written, then tail advanced): the NumPy views
    # and copies of each part cost about 8 us a record of 100 rows, and a worker pushes one per lookup that missed.
    size = words.shape[0] * 8
    n, dim = rows.shape
    length = 8 * _HEADER + 16 * n + ((4 * n * dim + 7) // 8) * 8
    if length > size // 2:
        return False
    head = atomic_load(ctrl, CTRL_HEAD)
    tail = ctrl[CTRL_TAIL]
    pos = tail % size
    pad = size - pos if pos + length > size else 0
    if tail + pad + length - head > size:
        return False
    if pad:
        words[pos // 8] = pad
        if pad >= 16:  # the last 8 bytes hold a length alone (a record is never shorter than its header)
            words[pos // 8 + 1] = KIND_PAD
        pos = 0
    w = pos // 8
    words[w] = length
    words[w + 1] = kind
    words[w + 2] = table
    words[w + 3] = n
    words[w + 4] = dim
    words[w + 5] = generation
    words[w + 6] = hit_bits
    words[w + 7] = 0
    w += _HEADER
    for i in range(n):
        words[w + i] = keys[i]
        words[w + n + i] = versions[i]
    f = 2 * (w + 2 * n)
    for i in range(n):
        for d in range(dim):
            floats[f + i * dim + d] = rows[i, d]
    atomic_fetch_add(ctrl, CTRL_TAIL, pad + length)
    return True


@dataclass
class Record:
    kind: int
    table: int
    generation: int
    hit_rate: float
    keys: np.ndarray
    versions: np.ndarray
    rows: np.ndarray


def record_bytes(n: int, dim: int) -> int:
    """Bytes of a record of ``n`` rows of width ``dim`` (header included, padded)."""
    return 8 * _HEADER + 16 * n + -(-(4 * n * dim) // 8) * 8


class Ring:
    """One ring: ``ctrl`` int64 (head and tail on their own cache lines) and ``data`` uint8 of a power-of-two size."""

    def __init__(self, ctrl: np.ndarray, data: np.ndarray) -> None:
        self.ctrl = ctrl
        self.data = data
        self.size = data.shape[0]
        if self.size & (self.size - 1) or self.size < 4096:
            raise ValueError(f"ring size must be a power of two >= 4096, got {self.size}")
        self._words = data.view(np.int64)  # records start at multiples of 8 bytes: header, keys and versions
        self._floats = data.view(np.float32)  # and their rows

    def push(self, kind: int, table: int, generation: int, hit_rate: float, keys: np.ndarray, versions: np.ndarray,
             rows: np.ndarray) -> bool:
        """Append a record (producer only); False when it does not fit now."""
        return bool(_append(self.ctrl, self._words, self._floats, kind, table, generation,
                            np.float64(hit_rate).view(np.int64), keys, versions, rows))

    def empty(self) -> bool:
        return int(_load(self.ctrl, CTRL_TAIL)) == int(self.ctrl[CTRL_HEAD])

    def pop_all(self, limit_bytes: int = 1 << 26) -> list[Record]:
        """Copy out the records appended so far (consumer only), up to about ``limit_bytes``, and free their space."""
        tail = int(_load(self.ctrl, CTRL_TAIL))
        head = start = int(self.ctrl[CTRL_HEAD])
        out: list[Record] = []
        words, floats = self._words, self._floats
        while head < tail and head - start < limit_bytes:
            pos = head % self.size
            w = pos // 8
            length = int(words[w])
            if length <= 0 or length > self.size:
                raise RuntimeError(f"corrupt queue record of {length} bytes at {head}")
            # a record with no room for a header before the end is the padding that sends the next one to 0
            if pos + 8 * _HEADER <= self.size:
                _, kind, table, n, dim, generation, hit_bits, _ = words[w:w + _HEADER].tolist()
                if kind != KIND_PAD:
                    w += _HEADER
                    f = 2 * (w + 2 * n)
                    out.append(Record(kind, table, generation, float(np.int64(hit_bits).view(np.float64)),
                                      words[w:w + n].copy(), words[w + n:w + 2 * n].copy(),
                                      floats[f:f + n * dim].reshape(n, dim).copy()))
            head += length
        if head != start:
            _advance(self.ctrl, CTRL_HEAD, head - start)
        return out
