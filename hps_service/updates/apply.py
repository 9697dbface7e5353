"""Turning one polled batch of update messages into engine changes and applying it durably.

Reading a batch gathers one change per table, dead-letters the messages that cannot be applied on their own
(malformed, or not fitting the loaded model), notes the partitions to park (their model is not loaded) and the
gaps to read again. Applying it writes the changes and the positions they bring their partitions to in one atomic
engine call, retried until it is done: an update counts as applied only once it is durable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from confluent_kafka import KafkaError, Message

from hps_service.config.base import served_name, split_served
from hps_service.engine import TableChange
from hps_service.engine.api import Engine
from hps_service.engine.write import PreparedChange
from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.updates.admin_signature import AdminMessages
from hps_service.updates.batch import TableBatch, table_change
from hps_service.updates.consumed import headers as consumed_headers
from hps_service.updates.consumed import position
from hps_service.updates.dead_letters import DeadLetters
from hps_service.updates.gaps import OffsetGaps
from hps_service.updates.message import DecodedUpdate, MalformedUpdateError, decode_update
from hps_service.updates.metrics import FreshnessStats

if TYPE_CHECKING:
    from hps_service.updates.assignment import Assignment

log = logging.getLogger(__name__)

Partition = tuple[str, int]


class ModelUnloadedError(Exception):
    """The model of a message is not loaded now (its partition is parked until it is)."""


@dataclass
class Applied:
    """What applying a batch left undone: models unloaded meanwhile (their partitions are parked)."""

    unloaded: set[str] = field(default_factory=set)


@dataclass
class PolledBatch:
    """What one polled batch holds once read."""

    groups: dict[tuple[str, str], TableBatch]  # per (model, table)
    purges: dict[tuple[str, str], int]  # per (model, table), purge the tombstones below this version
    produced_at: dict[str, list[int]]  # per model
    offsets: dict[Partition, int]  # per partition, the next offset once this batch is applied
    first: dict[Partition, int]  # per partition, its first offset in this batch
    park: dict[Partition, int]  # per partition, the offset of its first message whose model is not loaded
    reread: dict[Partition, int]  # per partition, where a gap begins: read again from there
    letters: int  # dead letters sent before this batch was read


class BatchApply:
    """Reads polled batches and applies them to the engine (see the module docstring); runs in the consumer
    thread."""

    def __init__(self, engine: Engine, metrics: FreshnessStats, admin_messages: AdminMessages,
                 gaps: OffsetGaps, group: str, stopping: threading.Event, on_error: Callable[[str], None]) -> None:
        """``stopping`` ends the retries of a failing apply; ``on_error`` hears every error met."""
        self.engine = engine
        self.metrics = metrics
        self.admin_messages = admin_messages
        self.gaps = gaps
        self.group = group
        self._stopping = stopping
        self._on_error = on_error
        #: Why the current batch cannot be applied (a tier write fails); None once it is applied.
        self.apply_error: str | None = None

    def read(self, msgs: list[Message], assignment: Assignment, dlq: DeadLetters,
             out_of_range: Callable[[Partition], None]) -> PolledBatch:
        """Sort ``msgs`` into changes per table, dead-lettering what cannot be applied; ``out_of_range`` hears of
        a partition whose offset a fetch found out of its log."""
        groups: dict[tuple[str, str], TableBatch] = {}
        purges: dict[tuple[str, str], int] = {}
        produced_at: dict[str, list[int]] = {}
        offsets: dict[Partition, int] = {}
        first: dict[Partition, int] = {}
        park: dict[Partition, int] = {}
        reread: dict[Partition, int] = {}
        loaded = {m.name for m in self.engine.models()}
        letters = dlq.sent
        for msg in msgs:
            err = msg.error()
            if err is not None:
                err_topic, err_partition = msg.topic(), msg.partition()
                if (err.code() == KafkaError._AUTO_OFFSET_RESET and err_topic in assignment.topics
                        and err_topic is not None and err_partition is not None):
                    out_of_range((err_topic, err_partition))
                elif err.code() != KafkaError._PARTITION_EOF:
                    self._on_error(err.str())
                    log.warning("update consumer %s: %s", self.group, err.str())
                continue
            topic, partition, offset = position(msg)
            part = (topic, partition)
            model = assignment.topics.get(topic)
            if model is None or part in assignment.parked or part in park or part in reread:
                continue  # fetched before its partition was dropped, parked or sought back: read again from there
            gap = self.gaps.check(part, offset)
            if gap is not None:
                reread[part] = gap
                continue
            self.gaps.taken(part, offset)
            first.setdefault(part, offset)
            value = msg.value() or b""
            try:
                if model not in loaded:
                    raise ModelUnloadedError(model)
                upd = self._validated(model, value)
                self.admin_messages.check(model, upd, value, consumed_headers(msg))
            except ModelUnloadedError:
                park[part] = offset
                continue
            except MalformedUpdateError as exc:
                self._dead_letter(dlq, msg, model, str(exc))
            else:
                served = served_name(model, upd.model_version)  # a version's rows reach that version only
                if upd.purge_tombstones_below:
                    purges[(served, upd.table)] = max(purges.get((served, upd.table), 0), upd.purge_tombstones_below)
                else:
                    groups.setdefault((served, upd.table), TableBatch()).add(upd, msg)
                produced_at.setdefault(model, []).append(upd.produced_at_ns)
            offsets[part] = offset + 1
        return PolledBatch(groups, purges, produced_at, offsets, first, park, reread, letters)

    def apply(self, batch: PolledBatch, topics: dict[str, str], dlq: DeadLetters) -> bool:
        """Apply ``batch`` (``topics``: update topic -> model) once its dead letters are acknowledged; afterwards
        its ``offsets`` are where its partitions stand (those parked, at their parked offsets) and its ``park``
        names every partition to park. False when stopping first: the batch is read again."""
        done = Applied()
        changes = self._changes(batch.groups, done, dlq)
        if dlq.sent != batch.letters and not dlq.delivered(self._stopping):
            return False  # stopping: the batch is read again, its dead letters produced again
        applied = self._apply(changes, {p: o for p, o in batch.offsets.items() if p not in batch.park},
                              batch.purges, done, topics)
        if applied is None:
            return False  # stopping with this batch unapplied: its positions stay unstored and it is read again
        for model in applied.unloaded:  # unloaded while its batch was applied: read it all again once it is back
            batch.produced_at.pop(model, None)
            for part, offset in batch.first.items():
                if topics.get(part[0]) == model:
                    batch.park[part] = min(offset, batch.park.get(part, offset))
        for part, offset in batch.park.items():
            batch.offsets[part] = offset
        now_ns = time.time_ns()
        for model, stamps in batch.produced_at.items():
            lags = (now_ns - np.asarray(stamps, dtype=np.int64)) / 1e9
            self.metrics.record_lags(np.maximum(lags, 0.0), model)
        self.metrics.messages_total += sum(len(stamps) for stamps in batch.produced_at.values())
        self.metrics.batches_total += 1
        return True

    def _validated(self, model: str, payload: bytes | None) -> DecodedUpdate:
        upd = decode_update(payload)
        if upd.model != model:
            raise MalformedUpdateError(f"message for model {upd.model!r} on the topic of model {model!r}")
        served = served_name(model, upd.model_version)
        dim = self._table_dim(served, upd.table)
        if upd.keys.shape[0] and upd.dim != dim:
            raise MalformedUpdateError(f"rows of dim {upd.dim} for table {served}.{upd.table} of dim {dim}")
        return upd

    def _table_dim(self, model: str, table: str) -> int:
        """The dim of a loaded table of ``model`` (a served name); ModelUnloadedError when the model is not loaded,
        MalformedUpdateError when it has no such table or version (a version's rows wait for no one: its
        partition goes on for the model's other versions)."""
        try:
            return self.engine.table(model, table).dim
        except NotFoundError as exc:
            if not any(m.served_name == model for m in self.engine.served_models()) and not split_served(model)[1]:
                raise ModelUnloadedError(model) from None
            raise MalformedUpdateError(str(exc)) from None

    def _changes(self, groups: dict[tuple[str, str], TableBatch], done: Applied,
                 dlq: DeadLetters) -> list[PreparedChange]:
        """One change per table, checked by the engine (which hands it back ready to write). A change the engine
        refuses is checked message by message, and only the messages it refuses on their own are dead-lettered; a
        table whose model is not loaded is left out (``done``)."""
        changes = []
        for (model, table), batch in groups.items():
            try:
                change = self.engine.check_change(self._change(model, table, [batch]))
            except ModelUnloadedError:
                done.unloaded.add(model)
                continue
            except (InvalidArgumentError, MalformedUpdateError, NotFoundError) as exc:
                kept = []
                for msg in batch.messages:
                    single = TableBatch()
                    single.add(decode_update(msg.value()), msg)
                    try:
                        self.engine.check_change(self._change(model, table, [single]))
                        kept.append(single)
                    except ModelUnloadedError:
                        done.unloaded.add(model)
                        break
                    except (InvalidArgumentError, MalformedUpdateError, NotFoundError) as one:
                        self._dead_letter(dlq, msg, model,
                                          f"rejected by the engine: {one if len(batch.messages) > 1 else exc}")
                if model in done.unloaded or not kept:
                    continue
                change = self.engine.check_change(self._change(model, table, kept))
            changes.append(change)
        return changes

    def _change(self, model: str, table: str, batches: list[TableBatch]) -> TableChange:
        return table_change(model, table, batches, self._table_dim(model, table))

    def _apply(self, changes: list[PreparedChange], positions: dict[Partition, int],
               purges: dict[tuple[str, str], int], done: Applied, topics: dict[str, str]) -> Applied | None:
        """Write the changes and the positions they bring the partitions to in one atomic engine call (purges run
        between the rows and the positions); retry transient failures until done (None if stopping first). The
        changes, purges and positions of a model unloaded meanwhile are left for when it is back (``done``)."""
        backoff = 0.05
        while True:
            changes = [c for c in changes if c.model not in done.unloaded]
            purges = {k: v for k, v in purges.items() if k[0] not in done.unloaded}
            positions = {p: o for p, o in positions.items() if topics.get(p[0]) not in done.unloaded}
            try:
                if purges:
                    self.engine.apply_changes(changes)
                    for (model, table), below in purges.items():
                        self.engine.purge_tombstones(model, table, below)
                    self.engine.apply_changes([], positions)
                else:
                    self.engine.apply_changes(changes, positions)
                break
            except (NotFoundError, InvalidArgumentError) as exc:
                # validated a moment ago: a model was unloaded or replaced meanwhile; its partitions are parked at
                # this batch and read again (and checked again) once it is loaded
                loaded = {m.name for m in self.engine.models()}
                gone = {c.model for c in changes} | {m for m, _ in purges}
                if not gone:
                    raise
                done.unloaded |= (gone - loaded) or gone
                log.warning("update consumer %s: %s changed under a batch (%s); reading it again", self.group,
                            ", ".join(sorted(gone)), exc)
            except Exception as exc:  # noqa: BLE001  (a tier is down: retry the same rows, store nothing)
                self.metrics.apply_failures += 1
                tables = ", ".join(f"{c.model}.{c.table}" for c in changes) or "positions"
                error = f"apply to {tables} failed: {exc}"
                self._on_error(error)
                self.apply_error = error
                log.warning("update consumer %s: %s; retrying in %.2fs", self.group, error, backoff)
                if self._stopping.wait(backoff):
                    return None
                backoff = min(backoff * 2, 2.0)
        self.apply_error = None
        for c in changes:
            top = max(int(c.versions.max()) if c.versions.shape[0] else -1,
                      int(c.delete_versions.max()) if c.delete_versions.shape[0] else -1)
            self.metrics.record_applied(
                c.model, c.table,
                rows=int(np.unique(np.concatenate((c.keys, c.delete_keys))).shape[0]),
                received=int(c.keys.shape[0] + c.delete_keys.shape[0]),
                max_version=top if top >= 0 else None,
            )
        return done

    def _dead_letter(self, dlq: DeadLetters, msg: Message, model: str, reason: str) -> None:
        self.metrics.record_malformed(model)
        log.warning(
            "update consumer %s: malformed message %s[%d]@%d: %s",
            self.group, msg.topic(), msg.partition(), msg.offset(), reason,
        )
        dlq.send(msg, reason)
