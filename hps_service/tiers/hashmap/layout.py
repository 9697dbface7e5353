"""The arrays of a hash-map table, as the tier places them and readers in other processes map them: spelled here
once. A table named ``t`` is ``t/ctrl`` (int64 control words: the sequence lock, the clock, the index's generation
and length), ``t/meta`` (int64 ``(capacity, META_WORDS)``: key, version, the two int32 stamps), ``t/rows``
(float32 ``(capacity, words)``) and ``t/index.<generation>`` (int32 slots; a new generation when it grows)."""

from __future__ import annotations

#: The fixed arrays of a table (its index is apart: its name changes with its generation).
CTRL, META, ROWS = "ctrl", "meta", "rows"
PARTS = (CTRL, META, ROWS)
#: int64 words per row of ``meta``.
META_WORDS = 3
#: The arrays a reader that stamps its reads maps writable (the clock in ``ctrl``, its stamp halves in ``meta``);
#: every other array is read-only to readers.
READER_WRITABLE = (CTRL, META)


def part_name(table: str, part: str) -> str:
    """The allocation name of one of a table's fixed arrays."""
    return f"{table}/{part}"


def index_name(table: str, generation: int) -> str:
    """The allocation name of generation ``generation`` of a table's index."""
    return f"{table}/index.{generation}"
