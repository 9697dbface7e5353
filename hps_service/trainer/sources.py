"""Where training batches come from: the planted teacher (known oracle) or Criteo-format files, both resumable.

A source yields, for one data-parallel rank, its share of each global batch with the position after it (synthetic:
the step; files: rows consumed) and the global batch's size (files encode only the rank's rows), and a held-out
batch for evaluation (files: ``--eval-data``, or the first rows of the training data, which training then
skips).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.criteo import DENSE_FIELDS, CriteoFiles, encode
from hps_service.trainer.data import Batch, DriftSpec, PlantedTeacherData


class DataSource(Protocol):
    """What the trainer reads."""

    num_dense: int
    drift: DriftSpec | None

    def batches(self, batch_size: int, position: int, rank: int = 0, world: int = 1
                ) -> Iterator[tuple[Batch, int, int]]: ...

    def holdout(self, size: int, step: int) -> Batch: ...

    def total_steps(self, batch_size: int, position: int) -> int | None: ...

    def describe(self) -> dict: ...


@dataclass
class SyntheticSource:
    """The planted teacher: batch ``step`` is a pure function of (seed, step); its oracle is known."""

    data: PlantedTeacherData
    _holdouts: dict[bool, Batch] = field(default_factory=dict)

    @property
    def num_dense(self) -> int:
        return self.data.config.num_dense

    @property
    def drift(self) -> DriftSpec | None:
        return self.data.config.drift

    def batches(self, batch_size: int, position: int, rank: int = 0, world: int = 1
                ) -> Iterator[tuple[Batch, int, int]]:
        step = position
        while True:
            batch = self.data.batch(step, batch_size)
            yield batch.rows(shard_rows(batch_size, rank, world)), step + 1, batch_size
            step += 1

    def holdout(self, size: int, step: int) -> Batch:
        """The held-out set labelled by the teacher in force at ``step`` (cached per drift phase)."""
        phase = self.drift is not None and step >= self.drift.step
        if phase not in self._holdouts:
            self._holdouts[phase] = self.data.holdout(size, at_step=step)
        return self._holdouts[phase]

    def total_steps(self, batch_size: int, position: int) -> int | None:
        return None

    def describe(self) -> dict:
        return {"format": "synthetic", "seed": self.data.config.seed}


@dataclass
class FileSource:
    """Criteo-format files read as a stream; the first ``holdout_rows`` rows are held out unless ``eval_files``."""

    files: CriteoFiles
    holdout_rows: int
    eval_files: CriteoFiles | None = None
    drift: DriftSpec | None = None
    _holdout: Batch | None = None

    @property
    def num_dense(self) -> int:
        return len(DENSE_FIELDS)

    @property
    def _skip(self) -> int:
        return 0 if self.eval_files is not None else self.holdout_rows

    def batches(self, batch_size: int, position: int, rank: int = 0, world: int = 1
                ) -> Iterator[tuple[Batch, int, int]]:
        rows = position
        for table in self.files.tables(batch_size, skip_rows=self._skip + position):
            n = table.num_rows
            rows += n
            part = shard_rows(n, rank, world)
            yield encode(table.slice(part.start, part.stop - part.start), self.files.sparse_fields), rows, n

    def holdout(self, size: int, step: int) -> Batch:
        if self._holdout is None:
            source = self.eval_files or self.files
            self._holdout = source.head(min(size, self.holdout_rows) if self.eval_files is None else size)
            if len(self._holdout) < 2:
                raise InvalidArgumentError("the held-out data has fewer than 2 rows")
        return self._holdout

    def total_steps(self, batch_size: int, position: int) -> int | None:
        count = self.files.count_batches(batch_size, self._skip + position)
        return None if count is None else count

    def describe(self) -> dict:
        return {"format": self.files.file_format, "files": [str(p) for p in self.files.paths],
                "holdout_rows": self.holdout_rows, "eval_files": [str(p) for p in self.eval_files.paths]
                if self.eval_files else None}


def shard_rows(n: int, rank: int, world: int) -> slice:
    """The contiguous rows of a batch of ``n`` that ``rank`` of ``world`` trains on."""
    per = math.ceil(n / world)
    return slice(min(n, rank * per), min(n, (rank + 1) * per))
