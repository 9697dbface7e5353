"""How the RocksDB tier lays out what is not a table's rows: its reserved column families and the encodings of the
metadata and log positions it keeps in them."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

#: Column family holding ``dim:<table>``, ``count:<table>`` and ``tombstones:<table>`` entries (int64 LE values),
#: and the ``app:`` entries of :meth:`RocksDBTier.set_metadata`.
META_CF = "__hps_meta__"
#: Column family of the log positions written with the rows: ``<source>\0<partition u32 BE>`` -> next offset (i64 LE).
POSITIONS_CF = "__hps_positions__"
#: Column families that are not tables.
RESERVED_CFS = (META_CF, POSITIONS_CF, "default")
APP_PREFIX = "app:"


def meta_key(kind: str, table: str) -> bytes:
    return f"{kind}:{table}".encode()


def int_value(value: int) -> bytes:
    return int(value).to_bytes(8, "little", signed=True)


def position_key(source: str, partition: int) -> bytes:
    return source.encode() + b"\0" + int(partition).to_bytes(4, "big")


def parse_position_key(key: bytes) -> tuple[str, int]:
    return key[:-5].decode(), int.from_bytes(key[-4:], "big")


def drain(iterator: Iterable[object]) -> None:
    """Run an iterator of side effects to completion at C speed."""
    deque(iterator, maxlen=0)
