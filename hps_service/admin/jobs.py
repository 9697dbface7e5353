"""Background admin jobs (model import, snapshot restore) with progress that ``GET /v1/jobs/{id}`` reports.

Jobs run one at a time on a worker thread, so a long import never holds an HTTP worker or a gRPC thread,
and two bulk writes into the same store never race each other.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hps_service.engine.api import Engine
from hps_service.engine.convert import ConvertProgress
from hps_service.errors import HPSError, NotFoundError, UnavailableError
from hps_service.fleet.row_import import check_dim, import_rows, verify
from hps_service.fleet.s3_files import download_rows, is_s3
from hps_service.fleet.sharding import ShardMap
from hps_service.rows.sources import open_rows
from hps_service.tiers.base import Tier, TierCapability, tier_can

log = logging.getLogger(__name__)

JobState = Literal["pending", "running", "succeeded", "failed"]
#: Finished jobs remembered for GET /v1/jobs (older ones are forgotten first).
KEEP_FINISHED = 256


@dataclass
class Job:
    """One background job and its progress; mutated only by its worker thread (reads see whole values)."""

    id: str
    kind: str
    target: dict[str, Any]
    state: JobState = "pending"
    rows_total: int | None = None
    rows_done: int = 0
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    result: dict[str, Any] = field(default_factory=dict)
    #: What the job is doing now, where it has steps (an import: checking, then importing).
    phase: str | None = None

    def view(self) -> dict[str, Any]:
        """The JSON shape served by the REST API."""
        progress = None
        if self.rows_total:
            progress = min(1.0, self.rows_done / self.rows_total)
        elif self.state == "succeeded":
            progress = 1.0
        return {
            "id": self.id,
            "kind": self.kind,
            "target": self.target,
            "state": self.state,
            "rows_total": self.rows_total,
            "rows_done": self.rows_done,
            "progress": progress,
            "phase": self.phase,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "result": self.result,
        }


class JobRunner:
    """Queues jobs on one worker thread and keeps their state for polling."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hps-job")
        self._jobs: dict[str, Job] = {}
        self._futures: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, kind: str, target: dict[str, Any], work: Callable[[Job], dict[str, Any]]) -> Job:
        """Queue ``work(job)``; it reports progress through ``job`` and returns the job's result."""
        job = Job(id=uuid.uuid4().hex[:16], kind=kind, target=target)
        with self._lock:
            if self._closed:
                raise UnavailableError("the server is shutting down; no new jobs")
            self._jobs[job.id] = job
            self._forget_old()
            future = self._pool.submit(self._run, job, work)
            self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return job

    def _run(self, job: Job, work: Callable[[Job], dict[str, Any]]) -> None:
        job.started_at = time.time()
        job.state = "running"
        try:
            job.result = work(job)
            job.state = "succeeded"
        except HPSError as exc:
            job.error = str(exc)
            job.state = "failed"
        except Exception as exc:  # a job must end in a state, whatever broke
            log.exception("job %s (%s) failed", job.id, job.kind)
            job.error = f"{type(exc).__name__}: {exc}"
            job.state = "failed"
        finally:
            job.finished_at = time.time()
            log.info("job %s (%s) %s", job.id, job.kind, job.state)

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.state in ("succeeded", "failed")]
        for j in sorted(finished, key=lambda j: j.created_at)[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._jobs[j.id]

    def get(self, job_id: str) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFoundError(f"no job '{job_id}'") from None

    def list(self) -> list[Job]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda j: j.created_at)

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuse new jobs, drop queued ones, and let the running one finish within ``timeout_s`` (None: however
        long it takes); False when it is still running (the server's grace period bounds a shutdown)."""
        with self._lock:
            self._closed = True
            running = list(self._futures)
        self._pool.shutdown(wait=False, cancel_futures=True)
        _, not_done = wait(running, timeout=timeout_s)
        if not_done:
            log.warning("a job was still running when the server stopped waiting for it")
        return not not_done


def writable_persistent(engine: Engine, what: str, needs: TierCapability) -> Tier:
    """The engine's persistent tier if it ``needs`` and writes, or UnavailableError naming why ``what`` cannot run."""
    tier = engine.persistent
    if not tier_can(tier, needs):
        raise UnavailableError(f"{what} needs persistent.type rocksdb")
    if TierCapability.WRITES not in tier.capabilities:
        raise UnavailableError(f"{what} needs a writable persistent tier, but persistent.read_only is true")
    return tier


def import_tier(engine: Engine) -> Tier:
    """The persistent tier that an import job bulk-loads, or UnavailableError naming why there is none."""
    return writable_persistent(engine, "import", TierCapability.BULK_IMPORT)


def convert_job(engine: Engine, model: str, table: str, storage: str) -> Callable[[Job], dict[str, Any]]:
    """The work of ``POST .../tables/{table}:convert``: re-encode the table as ``storage`` while it is served, then
    serve it so (see :mod:`hps_service.engine.convert`); ``rows_total`` counts the entries to copy."""

    def work(job: Job) -> dict[str, Any]:
        def report(total: int, done: int) -> None:
            job.rows_total, job.rows_done = total, done

        return engine.convert_table(model, table, storage, ConvertProgress(report))

    return work


def import_job(
    engine: Engine, model: str, table: str, path: Path | str, version: int, shard_map: ShardMap | None = None,
    staging: Path | None = None,
) -> Callable[[Job], dict[str, Any]]:
    """The work of ``POST .../import``: the rows at ``path`` (a server-side path, or an ``s3://`` URL downloaded into
    ``staging`` first and removed after), checked whole, then this shard's imported a batch at a time, each batch
    bulk-loaded into L3 with its keys evicted from L2 and L1 as one write of the table (see
    :meth:`LookupEngine.import_rows`); ``rows_total`` counts the rows of each pass (``phase`` says which)."""

    def work(job: Job) -> dict[str, Any]:
        tier = import_tier(engine)
        t = engine.table(model, table)
        with staged_rows(str(path), staging) as local:
            source = open_rows(local, table)
            check_dim(source, t.id, t.dim)

            def report(done: int, total: int) -> None:
                job.rows_done, job.rows_total = done, total

            job.phase = "checking"
            verify(source, progress=report)
            job.phase = "importing"
            counts = import_rows(source, lambda k, v: engine.import_rows(model, table, k, v, version=version),
                                 shard_map, report)
        return {**counts.as_json(), "rows_stored": tier.count(t.id)}

    return work


@contextmanager
def staged_rows(path: str, staging: Path | None) -> Iterator[Path]:
    """The local path of the rows at ``path``: itself, or (an ``s3://`` URL) a download into a directory of its own
    under ``staging`` (the system's temporary directory when None), removed after."""
    if not is_s3(path):
        yield Path(path)
        return
    if staging is not None:
        staging.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="import-", dir=staging))
    try:
        yield download_rows(path, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
