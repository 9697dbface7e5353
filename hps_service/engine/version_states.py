"""What each version of a model is doing, as ``GET /v1/models/{m}/versions``, the metrics and a label switch see it.

A version is in one state:

* ``loading``: its rows are being imported (a version from the model repository: not served yet), or a table of it
  is being preloaded into the volatile tier;
* ``ready``: served by this replica, whole; a label may point at it;
* ``failed``: its import failed (the reason is kept); it is never served, and tried again only when its files change;
* ``serving``: ready, and a label names it;
* ``draining``: being dropped (retired by ``keep_versions``, deleted from the repository, or ``DELETE``d).

Beside it: where it came from (``source``: the REST API, the registration log, ``hps import``, the repository's
URL), and when it became ready here. The source of a served version is kept in the persistent tier's metadata, so a
restart still says where it came from.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from hps_service.config.base import split_served
from hps_service.tiers.base import Tier, TierCapability, tier_can

State = Literal["loading", "ready", "failed", "serving", "draining"]
STATES: tuple[State, ...] = ("loading", "ready", "failed", "serving", "draining")
#: What the engine records of a version: importing (not served), failed, being dropped, or served.
Phase = Literal["importing", "failed", "draining", "served"]
_SOURCE_PREFIX = "version-source:"


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """What the engine knows of a version beside its registration: its phase, source, progress and times."""

    phase: Phase
    source: str
    reason: str | None = None
    rows_done: int = 0
    rows_total: int | None = None
    #: Wall clock when it was registered here (served from then on), or None.
    served_at: float | None = None
    #: What the source looked like when the phase was set (a repository version's listing), to tell a change.
    signature: str = ""
    since: float = field(default_factory=time.time)
    #: Whether ``source`` is kept in the store (a restart reads it back).
    stored: bool = False

    def loading_reason(self, described: str) -> str:
        """Why a label cannot point at a version being imported, with its progress."""
        of = f" of {self.rows_total:,}" if self.rows_total is not None else ""
        return f"{described} is loading from {self.source} ({self.rows_done:,}{of} rows imported)"


@dataclass(frozen=True, slots=True)
class TableView:
    """One table of a version: its rows here (the lowest tier's count) and their stored bytes."""

    name: str
    dim: int
    storage: str
    rows: int | None
    bytes: int | None


@dataclass(frozen=True, slots=True)
class VersionView:
    """A version as the REST API and the metrics show it."""

    model: str
    version: int
    state: State
    reason: str | None
    source: str
    ready_at: float | None
    labels: list[str]
    tables: list[TableView]
    rows_done: int | None = None
    rows_total: int | None = None

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "version": self.version, "state": self.state, "reason": self.reason, "source": self.source,
            "ready_at": self.ready_at, "labels": self.labels,
            "tables": [{"name": t.name, "dim": t.dim, "storage": t.storage, "rows": t.rows, "bytes": t.bytes}
                       for t in self.tables]}
        if self.rows_done is not None:
            out["progress"] = {"rows_done": self.rows_done, "rows_total": self.rows_total}
        return out


class VersionStates:
    """The records of every version this engine knows of beyond its registry, by served name; the sources of served
    versions are kept in ``tier``'s metadata."""

    def __init__(self, tier: Tier | None) -> None:
        self._tier = tier if tier_can(tier, TierCapability.WRITES) else None
        self._lock = threading.Lock()
        self._records: dict[str, VersionRecord] = {}
        if tier is not None:
            for key, value in tier.metadata(_SOURCE_PREFIX).items():
                name = key[len(_SOURCE_PREFIX):]
                self._records[name] = VersionRecord("served", value.decode(errors="replace"), stored=True)

    def _set(self, name: str, record: VersionRecord | None) -> None:
        with self._lock:
            if record is None:
                self._records.pop(name, None)
            else:
                self._records[name] = record

    def importing(self, name: str, source: str, signature: str = "") -> None:
        """``name`` is being imported from ``source`` (not served yet)."""
        self._set(name, VersionRecord("importing", source, signature=signature))

    def progress(self, name: str, done: int, total: int | None) -> None:
        """Rows of ``name`` imported so far, of ``total``."""
        with self._lock:
            record = self._records.get(name)
            if record is not None and record.phase == "importing":
                self._records[name] = replace(record, rows_done=done, rows_total=total)

    def failed(self, name: str, source: str, reason: str, signature: str = "") -> None:
        """The import of ``name`` from ``source`` failed: it is not served (and not tried again unchanged)."""
        self._set(name, VersionRecord("failed", source, reason=reason, signature=signature))

    def served(self, name: str, source: str, signature: str = "") -> None:
        """``name`` is registered (served) from now on; its source is kept across a restart."""
        before = self.record(name)
        source = source or (before.source if before is not None else "")
        stored = before is not None and before.stored and before.source == source
        if self._tier is not None and source and not stored and split_served(name)[1]:
            stored = self._tier.set_metadata(_SOURCE_PREFIX + name, source.encode())
        self._set(name, VersionRecord("served", source, served_at=time.time(), signature=signature, stored=stored))

    def draining(self, name: str) -> None:
        """``name`` is being dropped."""
        with self._lock:
            record = self._records.get(name)
            self._records[name] = replace(record, phase="draining") if record is not None else VersionRecord(
                "draining", "")

    def forget(self, name: str) -> None:
        """``name`` is gone: dropped, or its failure cleared."""
        self._set(name, None)
        if self._tier is not None and self._tier.metadata(_SOURCE_PREFIX + name):
            self._tier.set_metadata(_SOURCE_PREFIX + name, None)

    def record(self, name: str) -> VersionRecord | None:
        """What is known of ``name`` beside its registration, or None."""
        return self._records.get(name)

    def unserved(self, model: str) -> dict[int, VersionRecord]:
        """The versions of ``model`` known here but not served: being imported, or failed."""
        with self._lock:
            records = list(self._records.items())
        out = {}
        for name, record in records:
            of, version = split_served(name)
            if of == model and version and record.phase in ("importing", "failed"):
                out[version] = record
        return out


def view_of(model: str, version: int, record: VersionRecord | None, labels: list[str], tables: list[TableView],
            preloading: list[str], ready_at: float | None) -> VersionView:
    """The state of one version from what the engine knows of it: its record, its labels, the tables still being
    preloaded, and when the last of its preloads ended (None: none ran)."""
    source = record.source if record is not None else ""
    phase = record.phase if record is not None else "served"
    if record is not None and phase in ("importing", "failed"):
        loading = phase == "importing"
        return VersionView(model, version, "loading" if loading else "failed", record.reason, source, None, labels,
                           tables, record.rows_done if loading else None, record.rows_total if loading else None)
    if phase == "draining":
        return VersionView(model, version, "draining", None, source, None, labels, tables)
    if preloading:
        return VersionView(model, version, "loading", f"preloading {', '.join(preloading)} into the volatile tier",
                           source, None, labels, tables)
    served_at = record.served_at if record is not None else None
    ready = max((t for t in (served_at, ready_at) if t is not None), default=None)
    return VersionView(model, version, "serving" if labels else "ready", None, source, ready, labels, tables)
