"""Serving-side scoring: the newest exported dense tower plus embedding rows fetched from the parameter server.

``Predictor(export_dir, "host:port")`` loads the newest artifact under ``export_dir`` (a directory or s3://...) and
scores feature rows with rows looked up through ``HPSClient``; any client object with the same
``lookup_many(model, {table: keys}) -> {table: answer with .vectors}`` works (a colocated ``LocalClient``, or the
trainer's ``LatestRowStore``). Each distinct key is asked for once per batch. The tower runs in fp32 in eval mode
and belongs to this Predictor alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.criteo import CriteoFiles, FileFormat, encode, expand_paths
from hps_service.trainer.data import Batch
from hps_service.trainer.export import latest_version, load_tower
from hps_service.trainer.model import DenseTower, predict_from_rows


class LookupClient(Protocol):
    """What the Predictor needs of a client."""

    def lookup_many(self, model: str, keys_by_table: dict[str, np.ndarray]) -> dict[str, Any]: ...


class Predictor:
    """Scores samples with the newest exported tower and served embedding rows."""

    def __init__(self, export_dir: str | Path, client: str | LookupClient, model: str | None = None,
                 timeout: float = 10.0) -> None:
        self.export_dir = str(export_dir)
        self._owns_client = isinstance(client, str)
        if isinstance(client, str):
            from hps_service.client import HPSClient

            client = HPSClient(client, timeout=timeout)
        self.client: LookupClient = client
        self._model_override = model
        self.tower: DenseTower | None = None
        self.meta: dict[str, Any] = {}
        self.reload()

    @property
    def version(self) -> int:
        """Row version the loaded tower was trained to."""
        return int(self.meta["version"])

    @property
    def model(self) -> str:
        return self._model_override or str(self.meta["model"])

    def reload(self) -> bool:
        """Load the newest artifact if it is not the one loaded; returns whether it changed."""
        newest = latest_version(self.export_dir)
        if self.tower is not None and newest == self.meta.get("version"):
            return False
        self.tower, self.meta = load_tower(self.export_dir, newest)
        return True

    def rows(self, batch: Batch) -> dict[str, np.ndarray]:
        """Served rows of every id of the batch, per table (``batch.sparse[t].ravel()`` order)."""
        assert self.tower is not None
        uniques, inverses = {}, {}
        for spec in self.tower.config.tables:
            if spec.name not in batch.sparse:
                raise InvalidArgumentError(f"batch has no ids for table {spec.name!r}")
            uniques[spec.name], inverses[spec.name] = np.unique(batch.sparse[spec.name].ravel(), return_inverse=True)
        answers = self.client.lookup_many(self.model, uniques)
        return {name: np.asarray(answers[name].vectors)[inverses[name]] for name in uniques}

    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of an encoded batch."""
        assert self.tower is not None
        return predict_from_rows(self.tower, self.rows(batch), batch)

    def predict_raw(self, table: Any) -> np.ndarray:
        """Click probabilities of raw Criteo-format rows (a pyarrow Table or RecordBatch; the label may be absent)."""
        assert self.tower is not None
        return self.predict(encode(table, self.tower.config.table_names, require_label=False))

    def score_files(self, paths: Sequence[str | Path], file_format: FileFormat, batch_size: int = 4096,
                    limit: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(probabilities, labels) batch by batch over Criteo-format files (at most ``limit`` rows)."""
        assert self.tower is not None
        files = CriteoFiles(expand_paths(paths), file_format, self.tower.config.table_names)
        seen = 0
        for batch in files.batches(batch_size):
            if limit is not None and seen >= limit:
                return
            if limit is not None and seen + len(batch) > limit:
                batch = batch.rows(slice(0, limit - seen))
            seen += len(batch)
            yield self.predict(batch), batch.labels

    def close(self) -> None:
        if self._owns_client:
            self.client.close()  # type: ignore[attr-defined]  # the client it made itself has close()

    def __enter__(self) -> Predictor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
