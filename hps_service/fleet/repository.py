"""The model repository (``repository: {url, poll_s}``): every replica lists it every ``poll_s``, imports each new
version of a model it serves, and serves it beside the model once it is whole; a label switch then makes it live on
every replica at once (through the registration log), and a rollback is another switch.

When a version is complete (imported): every table of the model has its file (``<table>.npz``, ``.parquet``,
``.safetensors`` or a HugeCTR ``<table>/``), and, in a directory, two listings in a row, ``poll_s`` apart, showed the
version's files unchanged (so a file still being written is not read half-way; an S3 object is whole once it is
listed, so a bucket's version is taken at the first listing that shows every table). No marker file is needed. Then
each file must parse with its table's dim, or the version is ``failed`` with the reason: a version missing a table's
file, with a file of a table the model does not have, with a corrupt file or one of the wrong dim is never served,
and is tried again only once its files change. Rows are imported streamed (:mod:`hps_service.fleet.row_import`, this
shard's only) into tier ids of the version's own, then the version is registered here (not through the registration
log: each replica imports its own), preloaded, and ``ready``. The imports run at a lower CPU priority than serving.

Of a model's versions in the repository, the ``keep_versions`` newest are imported; older ones the model serves
are retired as a new version arrives (a labelled one never is). A version deleted from the repository is unloaded
here, unless a label names it. A version imported before a restart is served again from the store; one whose import
a stop interrupted is imported again (what it had written freed first).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hps_service.config import ModelConfig, RepositoryConfig, TableConfig
from hps_service.config.base import served_name
from hps_service.engine.api import Engine
from hps_service.engine.registry import described
from hps_service.engine.stored_tables import TableNames
from hps_service.engine.ttl import now_s
from hps_service.errors import HPSError, InvalidArgumentError, NotFoundError
from hps_service.fleet.repository_store import Repository, VersionListing, open_repository
from hps_service.fleet.row_import import check_dim, import_rows, tier_writer
from hps_service.fleet.sharding import ShardMap
from hps_service.rows import row_format
from hps_service.rows.sources import RowSource, open_rows
from hps_service.runtime.background import BackgroundThread
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)
#: How much lower the CPU priority of the imports is than serving's (its downloads' threads inherit it).
BACKGROUND_NICE = 10


class RepositoryPoller:
    """Pulls the versions of the repository into one replica (see the module docstring)."""

    def __init__(self, cfg: RepositoryConfig, engine: Engine, changed: Callable[[], None], staging: Path,
                 shard_map: ShardMap | None = None, repository: Repository | None = None) -> None:
        """``changed()``: after a version is served or dropped (its registration is stored, health follows)."""
        self.cfg = cfg
        self.engine = engine
        self.changed = changed
        self.staging = staging
        self.shard_map = shard_map if shard_map is not None else ShardMap()
        self.repository = repository if repository is not None else open_repository(cfg.url)
        #: Served name -> the signature of its files at the last listing (complete once two listings agree).
        self._seen: dict[str, str] = {}
        self.last_listing: float | None = None
        self.last_error: str | None = None
        self.ignored = 0
        self.kept_deleted: list[str] = []
        self._worker = BackgroundThread("hps-repository", self._run, nice=BACKGROUND_NICE)

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._worker.stop(timeout)

    def _run(self) -> None:
        while not self._worker.stopping.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001  (logged; the next poll tries again)
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("model repository %s: poll failed", self.cfg.url)
            self._worker.stopping.wait(self.cfg.poll_s)

    def poll(self) -> None:
        """List the repository once and act on it: import what is new and complete, unload what was deleted."""
        try:
            listing, self.ignored = self.repository.list()
        except HPSError as exc:  # unreachable: nothing is taken for deleted
            self.last_error = str(exc)
            log.warning("model repository %s: %s", self.cfg.url, exc)
            return
        self.last_listing, self.last_error = time.time(), None
        kept: list[str] = []
        for model in self.engine.models():
            found = listing.get(model.name, {})
            kept += self._unload_deleted(model, found)
            for version in sorted(found)[-model.keep_versions:]:
                if self._worker.stopping.is_set():
                    return
                self._consider(model, found[version])
        self.kept_deleted = kept

    def _source(self, model: str, version: int) -> str:
        return f"{self.repository.url}/{model}/{version}"

    def _consider(self, model: ModelConfig, entry: VersionListing) -> None:
        """Import ``entry`` if it is new here and complete (its files unchanged since the last listing)."""
        name = served_name(model.name, entry.version)
        signature = entry.signature
        served = {m.served_name for m in self.engine.served_models()}
        record = self.engine.states.record(name)
        if name in served or (record is not None and record.phase == "failed" and record.signature == signature):
            return
        if not self.repository.atomic and self._seen.get(name) != signature:
            self._seen[name] = signature  # a file in a directory may still be being written: wait a listing
            return
        self._seen.pop(name, None)
        self._import(model, entry)

    def _unload_deleted(self, model: ModelConfig, found: dict[int, VersionListing]) -> list[str]:
        """Unload the versions of ``model`` this repository gave that it no longer holds (a labelled one is kept);
        forget failures of versions gone. Returns the kept ones, described."""
        kept = []
        labelled = self.engine.labels.labelled(model.name)
        for version, failed in self.engine.states.unserved(model.name).items():
            if version not in found and failed.phase == "failed":
                self.engine.states.forget(served_name(model.name, version))
        for config in self.engine.versions(model.name):
            record = self.engine.states.record(config.served_name)
            if config.version in found or record is None or record.source != self._source(model.name,
                                                                                            config.version):
                continue
            if config.version in labelled:
                kept.append(f"{described(config.served_name)} (labelled)")
                continue
            log.info("%s was deleted from the model repository: unloading it", described(config.served_name))
            self.engine.drop_version(model.name, config.version)
            self.changed()
        return kept

    def _import(self, model: ModelConfig, entry: VersionListing) -> None:
        """Import every table of ``entry``, then serve it; on any failure free what was written and mark it
        failed with the reason."""
        name, source = served_name(model.name, entry.version), self._source(model.name, entry.version)
        self.engine.states.importing(name, source, entry.signature)
        log.info("%s: importing from %s", described(name), source)
        started = time.monotonic()
        where = self.staging / model.name / str(entry.version)
        written: dict[str, str] = {}
        try:
            self._free_leftovers(name, model)
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            sources = self._open(model, entry, where)
            self._write(name, model, sources, written)
            version = ModelConfig(name=model.name, version=entry.version, keep_versions=model.keep_versions,
                                  tables=model.tables)
            dropped = self.engine.add_version(version, source)
        except Exception as exc:  # noqa: BLE001  (any failure: the version is failed, the replica goes on)
            reason = str(exc) if isinstance(exc, HPSError) else f"{type(exc).__name__}: {exc}"
            log.error("%s from %s failed: %s", described(name), source, reason)
            self.engine.states.failed(name, source, reason, entry.signature)
            if written:
                try:
                    self.engine.finish_drop(name, written)
                except HPSError as exc:
                    log.error("%s: what its failed import wrote is not freed: %s", described(name), exc)
            return
        finally:
            shutil.rmtree(where, ignore_errors=True)
        log.info("%s imported from %s in %.1f s%s", described(name), source, time.monotonic() - started,
                 f"; retired versions {dropped}" if dropped else "")
        self.changed()

    def _free_leftovers(self, name: str, model: ModelConfig) -> None:
        """Free the rows an import of ``name`` that a stop interrupted left in the store."""
        tier = self.engine.persistent
        assert tier is not None
        stored = TableNames(tier)
        left = {tc.name: tid for tc in model.tables if _exists(tier, tid := stored.stored(name, tc.name).id)}
        if left:
            log.info("%s: freeing what an interrupted import left (%s)", described(name), ", ".join(left.values()))
            self.engine.finish_drop(name, left)

    def _open(self, model: ModelConfig, entry: VersionListing, where: Path) -> list[tuple[TableConfig, RowSource]]:
        """Every table's rows, fetched and opened, each checked against its table's dim, before anything is
        written; InvalidArgumentError naming what is missing, extra or wrong."""
        tables = {tc.name for tc in model.tables}
        extra = sorted(set(entry.tables) - tables)
        if extra:
            raise InvalidArgumentError(f"file(s) for {', '.join(extra)}: no table of model '{model.name}'")
        missing = sorted(t for t in tables if not any(f.complete for f in entry.tables.get(t, [])))
        if missing:
            raise InvalidArgumentError(f"no file for table(s) {', '.join(missing)} (a version is imported once every "
                                       "table of the model has its file)")
        doubled = sorted(t for t, files in entry.tables.items() if len(files) > 1)
        if doubled:
            raise InvalidArgumentError(f"more than one file for table(s) {', '.join(doubled)}")
        out = []
        for tc in model.tables:
            rows = open_rows(self.repository.fetch(entry, entry.tables[tc.name][0], where), tc.name)
            check_dim(rows, tc.name, tc.dim)
            out.append((tc, rows))
        return out

    def _write(self, name: str, model: ModelConfig, sources: list[tuple[TableConfig, RowSource]],
               written: dict[str, str]) -> None:
        """Import each table's rows under a tier id of the version's own (``written``: table -> id, as made)."""
        tier = self.engine.persistent
        assert tier is not None
        names = TableNames(tier)
        total, before = sum(rows.rows for _, rows in sources), 0

        def progress(done: int, _: int) -> None:
            self.engine.states.progress(name, before + done, total)

        for tc, rows in sources:
            stored = names.claim(name, tc.name)
            written[tc.name] = stored.id
            storage, written_s = stored.serving_storage(tc.storage), now_s() if tc.ttl_s is not None else None
            words = row_format(storage, tc.dim, stamped=written_s is not None).words
            write = tier_writer(tier, stored.id, tc.dim, storage, written_s=written_s,
                                mirror=self._volatile_for(stored.id, words, rows.rows))
            import_rows(rows, write, self.shard_map, progress, stopping=self._worker.stopping.is_set)
            before += rows.rows

    def _volatile_for(self, table_id: str, words: int, rows: int) -> Tier | None:
        """The volatile tier, when it is in this process and a table of it holds ``rows`` rows: filled as the rows
        are imported, it holds what the preload would have put there (None: lookups fill it, as without one)."""
        volatile = self.engine.volatile
        if volatile is None or not volatile.in_process:
            return None
        volatile.create_table(table_id, words)
        capacity = volatile.stats(table_id).capacity
        return volatile if capacity is None or rows <= capacity else None

    def stats(self) -> dict[str, Any]:
        """The ``repository`` section of /v1/stats."""
        return {"url": self.cfg.url, "poll_s": self.cfg.poll_s, "last_listing": self.last_listing,
                "last_error": self.last_error, "ignored_entries": self.ignored,
                "waiting": sorted(self._seen), "deleted_but_labelled": self.kept_deleted}


def _exists(tier: Tier, table_id: str) -> bool:
    """Whether ``tier`` holds a table ``table_id``."""
    try:
        tier.count(table_id)
    except NotFoundError:
        return False
    return True
