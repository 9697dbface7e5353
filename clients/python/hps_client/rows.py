"""Stored rows as a lookup with ``precision="stored"`` answers them: the table's fp32, fp16, bf16 or int8 rows as the
server holds them (hps.v1.RowStorage), with NumPy views of their parts and a decoder to float32.

A stored row is a whole number of 4-byte words: fp32 ``dim`` floats; fp16 / bf16 ``dim`` 16-bit values padded to a
word; int8 ``dim`` uint8 codes padded to a word, then a float32 scale and bias (``value = code * scale + bias``, as
FBGEMM's fused 8-bit rowwise rows). An inference service on a GPU moves these bytes and decodes them there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hps_client.errors import InternalError
from hps_client.proto.hps.v1 import rows_pb2

#: hps.v1.RowStorage values by name (``ROW_STORAGE_INT8`` -> ``"int8"``), and names by value.
STORAGE_CODES = {name.removeprefix("ROW_STORAGE_").lower(): int(code) for name, code in rows_pb2.RowStorage.items()}
STORAGE_NAMES = {code: name for name, code in STORAGE_CODES.items()}


def row_words(storage: str, dim: int) -> int:
    """The width of one stored row of ``dim`` values, in 4-byte words."""
    if storage == "fp32":
        return dim
    if storage in ("fp16", "bf16"):
        return (dim + 1) // 2
    return (dim + 3) // 4 + 2


@dataclass(frozen=True, slots=True)
class StoredRows:
    """``n`` stored rows of ``dim`` values: ``words`` is their bytes as a ``(n, row_words)`` uint32 array."""

    storage: str
    dim: int
    words: np.ndarray

    @classmethod
    def from_bytes(cls, storage: str, dim: int, count: int, data: bytes | memoryview) -> StoredRows:
        """The rows of a response's ``vectors`` bytes (a zero-copy view); InternalError if the sizes disagree."""
        width = row_words(storage, dim)
        if len(data) != 4 * width * count:
            raise InternalError(f"{len(data)} bytes of {storage} rows for {count} rows of dim {dim} "
                                f"({4 * width} bytes each)")
        return cls(storage, dim, np.frombuffer(data, dtype="<u4").reshape(count, width))

    def __len__(self) -> int:
        return int(self.words.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the rows take (what they cost on the wire)."""
        return int(self.words.nbytes)

    @property
    def halves(self) -> np.ndarray:
        """fp16 rows as ``(n, dim)`` float16, bf16 rows as ``(n, dim)`` uint16 bit patterns (views)."""
        if self.storage not in ("fp16", "bf16"):
            raise ValueError(f"{self.storage} rows have no 16-bit values")
        return self.words.view("<f2" if self.storage == "fp16" else "<u2")[:, : self.dim]

    @property
    def codes(self) -> np.ndarray:
        """int8 rows' ``(n, dim)`` uint8 codes (a view)."""
        self._int8()
        return self.words.view(np.uint8)[:, : self.dim]

    @property
    def scale(self) -> np.ndarray:
        """int8 rows' float32 scale per row (a view)."""
        self._int8()
        return self.words.view("<f4")[:, -2]

    @property
    def bias(self) -> np.ndarray:
        """int8 rows' float32 bias per row, the row's minimum (a view)."""
        self._int8()
        return self.words.view("<f4")[:, -1]

    def _int8(self) -> None:
        if self.storage != "int8":
            raise ValueError(f"{self.storage} rows have no codes, scale or bias")

    def to_float32(self) -> np.ndarray:
        """The rows decoded to a ``(n, dim)`` float32 array, the values the server answers with precision fp32."""
        if self.storage == "fp32":
            return self.words.view("<f4")
        if self.storage == "fp16":
            return self.halves.astype(np.float32)
        if self.storage == "bf16":
            return (self.halves.astype(np.uint32) << np.uint32(16)).view(np.float32)
        out = self.codes.astype(np.float32)
        out *= self.scale[:, None]
        out += self.bias[:, None]
        return out


@dataclass(slots=True)
class StoredAnswer:
    """Stored rows of one table in the order asked, and the level that answered each key (hps.v1.Source)."""

    rows: StoredRows
    sources: np.ndarray
