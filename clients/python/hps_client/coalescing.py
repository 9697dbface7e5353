"""Coalescing, the part the thread and asyncio transports share: which lookups may go out as one (a group), the
merged ``Lookup`` of a batch of them, and each caller's own outcome split back from its answer or its failure.

A group is one model, version or label, precision, set of tables and metadata (the credentials and trace context a
call carries): lookups of different groups never merge. A merged call carries the earliest deadline of its callers,
so none waits past its own. Its answer is split back by position (each caller's rows are views of the one
response). Its failure is each caller's where a caller alone would have met it too (the model, a table, the version
or label, the credentials, the replicas); any other failure (a limit of the merged size, the earliest deadline when
a caller's own is still ahead) sends each caller's lookup again, alone, so that no caller fails for another's sake.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import grpc
import numpy as np

from hps_client.calls import Call, Lookup, Rows
from hps_client.errors import HPSError
from hps_client.rows import StoredAnswer, StoredRows
from hps_client.wire import TableAnswer

#: How long a lookup waits for others while the client has calls in flight (seconds).
DEFAULT_WINDOW_S = 200e-6
#: Keys a merged call holds at most; a lookup of this many keys or more goes out on its own.
DEFAULT_MAX_KEYS = 1024
#: Failures of a merged call that each of its callers would have met alone: the group's model, tables, version or
#: label, credentials and replicas are the same for every caller in it.
SHARED_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE,
                          grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED})


class _Alone:
    """The outcome that tells a caller to send its lookup again on its own."""

    def __repr__(self) -> str:
        return "ALONE"


ALONE = _Alone()
_PENDING = object()


def check_settings(window_s: float, max_keys: int) -> None:
    """ValueError for a window below 0 or a budget below 2 keys."""
    if window_s < 0:
        raise ValueError(f"coalesce_window_s must be >= 0, got {window_s}")
    if max_keys < 2:
        raise ValueError(f"coalesce_max_keys must be >= 2, got {max_keys}")


class Member:
    """One caller of a batch: its call as made (a Rows or a Lookup), its keys by table and in all, and (once
    settled) its outcome."""

    __slots__ = ("call", "tables", "keys", "outcome")

    def __init__(self, call: Rows | Lookup, tables: dict[str, np.ndarray], keys: int) -> None:
        self.call = call
        self.tables = tables
        self.keys = keys
        self.outcome: Any = _PENDING

    @property
    def settled(self) -> bool:
        return self.outcome is not _PENDING


def joinable(call: Call[Any], max_keys: int) -> Member | None:
    """``call`` as a member of a batch, or None when it goes out as it is: not a lookup (a pooled one included: its
    answer is a row per bag), not small (``max_keys`` keys or more), or already past its deadline."""
    if isinstance(call, Rows):
        tables = {call.table: call.keys}
        keys = call.keys.shape[0]
    elif isinstance(call, Lookup) and not call.pooling:
        tables = call.tables
        keys = 0
        for arr in tables.values():
            keys += arr.shape[0]
    else:
        return None
    if keys >= max_keys or (call.deadline is not None and call.deadline <= time.monotonic()):
        return None
    return Member(call, tables, keys)


def group_of(member: Member) -> Hashable:
    """What lookups must share to go out as one."""
    call = member.call
    metadata: Any = call.metadata or None
    try:
        hash(metadata)  # the client's own: a tuple of pairs already
    except TypeError:
        metadata = tuple(tuple(item) for item in metadata)
    names = (call.table,) if isinstance(call, Rows) else tuple(sorted(call.tables))
    return (call.model, call.version, call.label, isinstance(call, Lookup) and call.stored, names, metadata)


class Batch:
    """Lookups of one group that go out as one call (at most ``max_keys`` keys in all)."""

    __slots__ = ("max_keys", "members", "keys", "sealed", "sent")

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.members: list[Member] = []
        self.keys = 0
        self.sealed = False  # no more members: it is full, or on its way
        self.sent = False  # its call is built: its members are fixed

    def fits(self, member: Member) -> bool:
        return not self.sealed and self.keys + member.keys <= self.max_keys

    def add(self, member: Member) -> None:
        self.members.append(member)
        self.keys += member.keys
        if self.keys >= self.max_keys:
            self.sealed = True

    def remove(self, member: Member) -> None:
        """A caller that gave up (cancelled) before the batch went out; once sent, its rows stay in the call."""
        if not self.sent and member in self.members:
            self.members.remove(member)
            self.keys -= member.keys

    def call(self) -> Call[Any]:
        """The call that goes out: a lone member's own, else the merged Lookup (the earliest deadline)."""
        self.sealed = self.sent = True
        if len(self.members) == 1:
            return self.members[0].call
        first = self.members[0].call
        deadlines = [m.call.deadline for m in self.members if m.call.deadline is not None]
        tables = {t: np.concatenate([m.tables[t] for m in self.members]) for t in self.members[0].tables}
        return Lookup(min(deadlines) if deadlines else None, first.metadata, first.model, tables, first.version,
                      first.label, isinstance(first, Lookup) and first.stored)

    def settle(self, answer: Any = None, error: BaseException | None = None) -> None:
        """Each member's outcome: its part of ``answer``, or what ``error`` means for it."""
        if len(self.members) == 1:
            self.members[0].outcome = error if error is not None else answer
            return
        if error is not None:
            for member in self.members:
                member.outcome = outcome_of_failure(member, error)
            return
        offsets = dict.fromkeys(answer, 0)
        for member in self.members:
            own: dict[str, TableAnswer | StoredAnswer] = {}
            for table, keys in member.tables.items():
                start = offsets[table]
                offsets[table] = end = start + keys.shape[0]
                own[table] = part_of(answer[table], start, end)
            if isinstance(member.call, Rows):
                rows = own[member.call.table]
                assert isinstance(rows, TableAnswer)
                member.outcome = rows.vectors
            else:
                member.outcome = own


def outcome_of_failure(member: Member, error: BaseException) -> Any:
    """``error`` as the member's own, or :data:`ALONE` where the member alone might have been answered."""
    if not isinstance(error, HPSError) or error.code in SHARED_CODES:
        return own_copy(error)
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        deadline = member.call.deadline
        return ALONE if deadline is None or deadline > time.monotonic() else own_copy(error)
    return ALONE


def own_copy(error: BaseException) -> BaseException:
    """An HPSError of its own for each caller (one raised in many threads or tasks would share its traceback)."""
    if type(error).__init__ is HPSError.__init__ and isinstance(error, HPSError):
        return type(error)(str(error), code=error.code, details=error.details)
    return error


def part_of(answer: TableAnswer | StoredAnswer, start: int, end: int) -> TableAnswer | StoredAnswer:
    """Rows ``start:end`` of one table's answer (views, no copy)."""
    if isinstance(answer, StoredAnswer):
        rows = answer.rows
        return StoredAnswer(StoredRows(rows.storage, rows.dim, rows.words[start:end]), answer.sources[start:end])
    return TableAnswer(answer.vectors[start:end], answer.sources[start:end])


def resolved(member: Member) -> Any:
    """The member's answer; raises its error. (:data:`ALONE` is the caller's to act on before.)"""
    outcome = member.outcome
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
