"""Where training batches come from: the planted teacher (known oracle) or Criteo-format files, both resumable.

A source yields, for one data-parallel rank, its share of each global batch with the position after it (synthetic:
the step; files: rows consumed; streams: a JSON-able dict) and the global batch's size (files encode only the
rank's rows); a stream yields ``(None, position, 0)`` while it waits for data, so the trainer can publish on time,
and returns once ``stop`` is set. A held-out batch for evaluation is the newest data: the last rows of the files
(``--holdout last:N``, never trained), a separate file (``--eval-data``), or fresh teacher samples; a source
without one answers None and progressive validation is the measure. Streams (``kafka://``, ``dir://`` with
``--follow``) live in ``stream_sources``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.criteo import DENSE_FIELDS, CriteoFiles, encode
from hps_service.trainer.data import Batch, DriftSpec, PlantedTeacherData

BatchItem = tuple[Batch | None, Any, int]


class DataSource(Protocol):
    """What the trainer reads (the properties may be plain attributes of a source)."""

    @property
    def num_dense(self) -> int: ...

    @property
    def drift(self) -> DriftSpec | None: ...

    @property
    def bounded(self) -> bool:
        """False: a stream that trains until stopped."""

    def batches(self, batch_size: int, position: Any, rank: int = 0, world: int = 1,
                stop: threading.Event | None = None) -> Iterator[BatchItem]: ...

    def holdout(self, size: int, step: int) -> Batch | None: ...

    def total_steps(self, batch_size: int, position: Any) -> int | None: ...

    def commit(self, position: Any) -> None:
        """Called once a checkpoint holding ``position`` is complete (a Kafka source commits its offsets)."""

    def close(self) -> None: ...

    def describe(self) -> dict: ...


class SourceBase:
    """What a source without a held-out set, a known length or input offsets answers."""

    def holdout(self, size: int, step: int) -> Batch | None:
        return None

    def total_steps(self, batch_size: int, position: Any) -> int | None:
        return None

    def commit(self, position: Any) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class SyntheticSource(SourceBase):
    """The planted teacher: batch ``step`` is a pure function of (seed, step); its oracle is known."""

    data: PlantedTeacherData
    _holdouts: dict[tuple[bool, int], Batch] = field(default_factory=dict)
    bounded: bool = True

    @property
    def num_dense(self) -> int:
        return self.data.config.num_dense

    @property
    def drift(self) -> DriftSpec | None:
        return self.data.config.drift

    def batches(self, batch_size: int, position: Any, rank: int = 0, world: int = 1,
                stop: threading.Event | None = None) -> Iterator[BatchItem]:
        step = int(position or 0)
        while True:
            batch = self.data.batch(step, batch_size)
            yield batch.rows(shard_rows(batch_size, rank, world)), step + 1, batch_size
            step += 1

    def holdout(self, size: int, step: int) -> Batch:
        """``size`` held-out samples labelled by the teacher in force at ``step`` (cached per drift phase and size)."""
        key = (self.drift is not None and step >= self.drift.step, size)
        if key not in self._holdouts:
            self._holdouts[key] = self.data.holdout(size, at_step=step)
        return self._holdouts[key]

    def describe(self) -> dict:
        return {"format": "synthetic", "seed": self.data.config.seed}


@dataclass
class FileSource(SourceBase):
    """Criteo-format files read as a stream, in order; ``holdout_last`` rows at their end are held out (never
    trained), or ``eval_files`` are the held-out set."""

    files: CriteoFiles
    holdout_last: int = 0
    eval_files: CriteoFiles | None = None
    drift: DriftSpec | None = None
    bounded: bool = True
    _holdout: Batch | None = None
    _rows: int | None = None

    def __post_init__(self) -> None:
        if self.holdout_last and self.eval_files is not None:
            raise InvalidArgumentError("--holdout last:N and --eval-data are two held-out sets: give one")

    @property
    def num_dense(self) -> int:
        return len(DENSE_FIELDS)

    def _train_rows(self) -> int | None:
        """Rows trained on when the files' tail is held out (``_rows_before_holdout``); None: all of them."""
        return self._rows_before_holdout() if self.holdout_last else None

    def _rows_before_holdout(self) -> int:
        """All rows but the held-out tail (counted once: Parquet metadata, or a pass over TSV lines)."""
        if self._rows is None:
            rows = self.files.count_rows()
            if rows <= self.holdout_last:
                raise InvalidArgumentError(f"--holdout last:{self.holdout_last} holds back all {rows} rows of "
                                           "the data: nothing is left to train on")
            self._rows = rows
        return self._rows - self.holdout_last

    def batches(self, batch_size: int, position: Any, rank: int = 0, world: int = 1,
                stop: threading.Event | None = None) -> Iterator[BatchItem]:
        rows = int(position or 0)
        end = self._train_rows()
        for table in self.files.tables(batch_size, skip_rows=rows):
            if end is not None:
                if rows >= end:
                    return
                table = table.slice(0, min(table.num_rows, end - rows))
            n = table.num_rows
            rows += n
            part = shard_rows(n, rank, world)
            yield encode(table.slice(part.start, part.stop - part.start), self.files.sparse_fields), rows, n

    def holdout(self, size: int, step: int) -> Batch | None:
        """The held-out rows: the files' last ``holdout_last`` rows, or the eval files' first ``size``."""
        if self._holdout is None:
            if self.eval_files is not None:
                self._holdout = self.eval_files.head(size)
            elif self.holdout_last:
                start = self._rows_before_holdout()
                self._holdout = next(iter(self.files.batches(self.holdout_last, skip_rows=start)))
            else:
                return None
            if len(self._holdout) < 2:
                raise InvalidArgumentError("the held-out data has fewer than 2 rows")
        return self._holdout

    def total_steps(self, batch_size: int, position: Any) -> int | None:
        rows = self._train_rows() if self.holdout_last else self.files.count_rows(exact=False)
        return None if rows is None else max(0, math.ceil((rows - int(position or 0)) / batch_size))

    def describe(self) -> dict:
        return {"format": self.files.file_format, "files": [str(p) for p in self.files.paths],
                "holdout_last": self.holdout_last, "eval_files": [str(p) for p in self.eval_files.paths]
                if self.eval_files else None}


def shard_rows(n: int, rank: int, world: int) -> slice:
    """The contiguous rows of a batch of ``n`` that ``rank`` of ``world`` trains on."""
    per = math.ceil(n / world)
    return slice(min(n, rank * per), min(n, (rank + 1) * per))
