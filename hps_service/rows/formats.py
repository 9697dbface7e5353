"""A table's row format: what its stored rows hold and how a float32 row is encoded into them and decoded back.

Every tier stores a row as ``words`` 4-byte words (typed float32, copied bit for bit), so the tiers, snapshots
and shared memory hold quantised rows without knowing it:

* ``fp32``: the float32 values, ``words == dim``;
* ``fp16`` / ``bf16``: two 16-bit values per word (round to nearest even), ``ceil(dim / 2)`` words;
* ``int8``: row-wise, as FBGEMM's fused 8-bit rowwise rows: ``dim`` uint8 codes padded to a word, then a float32
  scale and bias (``value = code * scale + bias``; the bias is the row's minimum, the scale its range / 255).

Rows are encoded once, when they are written, and decoded by the read path into the caller's float32 buffer.

A table with ``ttl_s`` (see :mod:`hps_service.engine.ttl`) stores its rows *stamped*: one more trailing word per
row, the row's write time as uint32 seconds since the Unix epoch (the word's bits; as a float32 it means nothing).
Every decoder here strips it before the format's own words are read (int8's scale and bias stay at ``[-2], [-1]``
of the unstamped row), so no decoder reads a stamp as data; :meth:`RowFormat.stamps` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import cast, get_args

import numpy as np

from hps_client.rows import row_words
from hps_service.config.base import Storage
from hps_service.errors import InvalidArgumentError
from hps_service.rows import kernels

STORAGES: tuple[str, ...] = get_args(Storage)
#: The largest finite fp16 magnitude: a row beyond it cannot be stored as fp16.
FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True, slots=True)
class RowFormat:
    """How rows of ``dim`` float32 values are stored: ``words`` 4-byte words per row."""

    storage: Storage
    dim: int
    #: Whether each stored row ends with its write time (one uint32 word; see the module docstring).
    stamped: bool = False

    @property
    def words(self) -> int:
        """Width of a stored row in 4-byte words (what the tiers and L1 see as the table's dim)."""
        return row_words(self.storage, self.dim) + int(self.stamped)

    @property
    def identity(self) -> bool:
        """Whether stored rows are the float32 rows themselves (nothing to encode or decode)."""
        return self.storage == "fp32" and not self.stamped

    @property
    def unstamped(self) -> RowFormat:
        """The same format without the write-time word."""
        return row_format(self.storage, self.dim)

    def stamps(self, stored: np.ndarray) -> np.ndarray:
        """The write times (uint32 seconds since the epoch, a view) of stamped rows ``(n, words)``."""
        if not self.stamped:
            raise ValueError(f"{self.storage} rows without a write time have no stamp")
        return stored[:, -1].view(np.uint32)

    def encode(self, vectors: np.ndarray, written_s: np.ndarray | int | None = None) -> np.ndarray:
        """Finite float32 rows ``(n, dim)`` -> stored rows ``(n, words)``; InvalidArgumentError for a row the
        format cannot hold (beyond fp16's range). ``written_s``: the rows' write times (seconds since the epoch,
        one or one per row), needed by a stamped format and ignored by the others."""
        if self.stamped:
            if written_s is None:
                raise ValueError("rows of a table with ttl_s need their write time")
            stamped = np.empty((vectors.shape[0], self.words), dtype=np.float32)
            stamped[:, :-1] = self.unstamped.encode(vectors)
            stamped[:, -1].view(np.uint32)[:] = np.clip(np.asarray(written_s, dtype=np.int64), 0, 2**32 - 1)
            return stamped
        if self.identity:
            return vectors
        self.check(vectors)
        n = vectors.shape[0]
        stored = np.zeros((n, self.words), dtype=np.float32)
        if self.storage == "fp16":
            stored.view(np.float16)[:, : self.dim] = vectors
        elif self.storage == "bf16":
            bits = np.ascontiguousarray(vectors, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            stored.view(np.uint16)[:, : self.dim] = rounded.astype(np.uint16)
        else:
            lo = vectors.min(axis=1, initial=np.inf) if n else np.empty(0, np.float32)
            hi = vectors.max(axis=1, initial=-np.inf) if n else np.empty(0, np.float32)
            scale = ((hi - lo) / np.float32(255)).astype(np.float32)
            safe = np.where(scale > 0, scale, np.float32(1))
            codes = np.rint((vectors - lo[:, None]) / safe[:, None])
            stored.view(np.uint8)[:, : self.dim] = np.clip(codes, 0, 255).astype(np.uint8)
            stored[:, -2] = scale
            stored[:, -1] = lo
        return stored

    def check(self, vectors: np.ndarray) -> None:
        """InvalidArgumentError when finite float32 rows ``(n, dim)`` hold a value the format cannot (beyond fp16's
        range), before anything is written."""
        if self.storage == "fp16" and vectors.size and float(np.abs(vectors).max()) > FP16_MAX:
            raise InvalidArgumentError(f"a row has a value beyond fp16's range (+-{FP16_MAX:g}); store the table as "
                                       "bf16 or fp32")

    def decode(self, stored: np.ndarray, out: np.ndarray) -> None:
        """Stored rows ``(n, words)`` -> float32 rows written into ``out`` ``(n, dim)``, C-contiguous."""
        if self.stamped:
            self.unstamped.decode(stored[:, :-1], out)
        elif self.identity:
            out[...] = stored
        elif self.storage == "bf16":
            kernels.decode_bf16(np.ascontiguousarray(stored), out)
        elif self.storage == "fp16":
            kernels.decode_fp16(np.ascontiguousarray(stored), out)
        else:
            kernels.decode_int8(np.ascontiguousarray(stored), out)

    def decoded(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows -> a new float32 ``(n, dim)`` array."""
        if self.stamped:
            return self.unstamped.decoded(np.ascontiguousarray(stored[:, :-1]))
        if self.identity:
            return stored
        out = np.empty((stored.shape[0], self.dim), dtype=np.float32)
        self.decode(stored, out)
        return out


def storage_key(table: str) -> str:
    """The tier metadata entry that records how ``table``'s rows are stored (absent: fp32, written before formats)."""
    return f"storage/{table}"


@cache
def row_format(storage: str, dim: int, stamped: bool = False) -> RowFormat:
    """The format of a table stored as ``storage`` with rows of ``dim`` values, ``stamped`` with their write time
    (a table with ``ttl_s``); InvalidArgumentError if the storage is unknown."""
    if storage not in STORAGES:
        raise InvalidArgumentError(f"unknown row storage {storage!r}; use one of {', '.join(STORAGES)}")
    return RowFormat(cast(Storage, storage), int(dim), bool(stamped))


def warm_up_kernels() -> None:
    """Compile (or load) every decoder with the arrays the read paths pass, before the server says ready."""
    for storage in STORAGES:
        fmt = row_format(storage, 3)
        fmt.decoded(fmt.encode(np.ones((2, 3), np.float32)))
