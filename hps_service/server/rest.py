"""The REST admin API (FastAPI): health, readiness, metrics, models, rows, import jobs, snapshots, stats, cache.

Only protocol translation lives here: every endpoint calls the engine, the job runner or the snapshot store.
Endpoints are plain ``def`` functions, so FastAPI runs them in its thread pool and a lookup never blocks the event
loop. The gatekeeper in front (:mod:`hps_service.server.gatekeeper`) admits each request, and bounds its body, per
:mod:`hps_service.server.rest_access` before the body is read: mutating endpoints need ``Authorization: Bearer
<server.admin_token>``, reads a reader's credential when ``server.auth`` is on. Errors are RFC 9457
``application/problem+json`` (``type``, ``title``, ``status``, ``detail``) with ``error`` (the same message) kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from hps_service.admin.jobs import JobRunner, convert_job, import_job, import_tier
from hps_service.admin.snapshots import Snapshots
from hps_service.config import HPSConfig, ModelConfig
from hps_service.engine import LEVELS
from hps_service.engine.api import Engine
from hps_service.errors import HPSError
from hps_service.fleet.registry_log import ModelRegistrations
from hps_service.fleet.row_import import check_dim
from hps_service.fleet.s3_files import is_s3, parse_s3
from hps_service.fleet.sharding import ShardMap
from hps_service.rows.sources import open_rows
from hps_service.runtime.gate import ServingGate
from hps_service.server import rest_models as rm
from hps_service.server.audit import AuditLog
from hps_service.server.auth import Authenticator
from hps_service.server.docs import add_offline_docs
from hps_service.server.gatekeeper import Gatekeeper, caller_of
from hps_service.server.metrics import ServerMetrics
from hps_service.server.probes import Readiness, ReadinessCheck, add_probe_routes
from hps_service.server.problems import PROBLEM_JSON
from hps_service.server.problems import problem as _error
from hps_service.server.rest_access import BodyLimits
from hps_service.server.rest_bodies import ConvertRequest, ImportRequest, PurgeTombstonesRequest, Wait
from hps_service.server.rest_models import ADMIN, INTERNAL, READ, answers, typed_openapi
from hps_service.server.rest_rows import ModelVersion, add_rows_routes
from hps_service.server.rest_versions import add_version_routes
from hps_service.server.rest_visibility import check_metrics, visible_job, visible_jobs, visible_models, visible_stats
from hps_service.server.status import http_status_for
from hps_service.server.unread_bodies import CloseUnread

if TYPE_CHECKING:
    from hps_service.fleet.admin_writes import LogWriter

__all__ = ["PROBLEM_JSON", "AdminContext", "ReadinessCheck", "SwitchableApp", "create_app", "create_starting_app"]

log = logging.getLogger(__name__)

#: The bearer credentials of a request (None when the header is missing or not a Bearer one).
AdminCredentials = Annotated[
    HTTPAuthorizationCredentials | None,
    Depends(HTTPBearer(auto_error=False, description="server.admin_token (or HPS_ADMIN_TOKEN)")),
]


@dataclass
class AdminContext:
    """What the admin API works on; owned by HPSServer."""

    engine: Engine
    config: HPSConfig
    metrics: ServerMetrics
    gate: ServingGate
    jobs: JobRunner
    #: The snapshots: local checkpoints, or the bucket's when persistent.snapshot_store is configured.
    snapshots: Snapshots[Any]
    #: What /readyz reports: the reasons the server is not ready and details (HPSServer.readiness).
    readiness: Readiness
    #: Registers and unloads models (through the registration log in a fleet), keeping health and the consumer in step.
    registrations: ModelRegistrations
    #: Extra sections of /v1/stats, e.g. ``{"updates": consumer.stats}``.
    stats_sections: dict[str, Callable[[], dict[str, Any]]] = field(default_factory=dict)
    #: The keys this server answers; others are refused with 421 naming their shard.
    shard_map: ShardMap = field(default_factory=ShardMap)
    #: GET /v1/cluster (the fields of hps.v1.ClusterInfo); None: built from shard_map and readiness.
    cluster_info: Callable[[], dict[str, Any]] | None = None

    #: With Kafka updates on: admin row writes go to the update topic (fleet.admin_writes.LogWriter).
    log_writer: Callable[[], LogWriter | None] = lambda: None
    #: Where rows downloaded from object storage wait for their import (None: a temporary directory).
    import_staging: Path | None = None


def describe_model(engine: Engine, name: str) -> dict[str, Any]:
    """Tables, dims, defaults and rows per tier of a loaded model."""
    mc = engine.model(name)
    tables = []
    for tc in mc.tables:
        stats = engine.table_stats(name, tc.name)
        rows = {level: (int(stats[level]["rows"] or 0) if stats[level].get("enabled") else None) for level in LEVELS}
        tables.append({"name": tc.name, "dim": tc.dim, "storage": tc.storage, "default": tc.model_dump()["default"],
                       "rows": rows})
    _, version = engine.resolve(name)
    return {"name": mc.name, "tables": tables, "versions": [v.version for v in engine.versions(name)],
            "labels": engine.labels.of(name), "default_version": version}


def create_starting_app(readiness: Readiness) -> FastAPI:
    """What the REST port answers while the server starts (a bootstrap may take minutes): liveness, and readiness
    with its progress; every other path 503."""
    app = FastAPI(title="hps-service admin API (starting)", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CloseUnread)
    add_probe_routes(app, readiness, list)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    def starting(path: str) -> JSONResponse:
        return _error(503, "the server is starting")

    return app


class SwitchableApp:
    """An ASGI app that serves ``target``, which can be replaced while the server runs (starting -> full API)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.target(scope, receive, send)


def create_app(ctx: AdminContext) -> FastAPI:
    """The admin FastAPI application over ``ctx``."""
    engine = ctx.engine
    app = FastAPI(
        title="hps-service admin API",
        version="1",
        description="Models, rows, import, snapshots, stats and cache control of one hps-service process. "
        "Mutating endpoints need `Authorization: Bearer <admin token>`.",
        docs_url=None, redoc_url=None,  # served from packaged assets (offline clusters): hps_service.server.docs
    )
    add_offline_docs(app)
    app.openapi = typed_openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to change the spec
    cfg = ctx.config.server
    auth = Authenticator(cfg)

    def dim_of(model: str, table: str) -> int | None:
        try:
            return engine.table(model, table).dim
        except HPSError:
            return None

    app.add_middleware(Gatekeeper, router=app.router, auth=auth, audit=AuditLog(cfg.audit_log),
                       limits=BodyLimits(cfg.max_batch_keys, cfg.max_body_bytes, dim_of),
                       internal_on=cfg.expose_internal_on)
    app.add_middleware(CloseUnread)  # outermost: a request answered before its body was read closes its connection

    def require_admin(credentials: AdminCredentials) -> None:
        """The gatekeeper has checked the token; checked again here, so no admin route runs without it."""
        auth.admin(credentials.credentials if credentials is not None else None)

    admin = [Depends(require_admin)]

    # ---- errors -----------------------------------------------------------------------------------
    @app.exception_handler(HPSError)
    def _domain_error(_request: Request, exc: HPSError) -> JSONResponse:
        return _error(http_status_for(exc), str(exc))

    @app.exception_handler(HTTPException)
    def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        summary = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors[:5])
        return _error(422, f"invalid request: {summary}", errors=errors)

    @app.exception_handler(ValidationError)
    def _model_error(request: Request, exc: ValidationError) -> JSONResponse:
        """A model an endpoint builds from the request's values (a version's tables) that does not validate."""
        return _validation_error(request, RequestValidationError(exc.errors(include_url=False)))

    @app.exception_handler(Exception)
    def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error in the admin API", exc_info=exc)
        return _error(500, "internal error; see the server log")

    # ---- health -----------------------------------------------------------------------------------
    add_probe_routes(app, ctx.readiness, lambda: [m.name for m in engine.models()])

    @app.get("/v1/cluster", tags=["health"], summary="Shard map: shards, this shard, partitions per topic, readiness",
             operation_id="getClusterInfo", response_model=rm.ClusterInfo, responses=answers(*READ))
    def cluster() -> dict[str, Any]:
        if ctx.cluster_info is not None:
            return ctx.cluster_info()
        m = ctx.shard_map
        not_ready, _ = ctx.readiness()
        return {"shards": m.shards, "shard": m.shard, "partitions": m.partitions, "partitioner": "murmur2",
                "owned_partitions": m.owned_partitions(), "topic_partitions": {}, "ready": not not_ready,
                "not_ready": not_ready}

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response,
             operation_id="getMetrics", responses={
                 200: {"description": "the Prometheus text exposition",
                       "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}, **answers(*INTERNAL)})
    def metrics(request: Request) -> Response:
        check_metrics(caller_of(request.state))
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- models -----------------------------------------------------------------------------------
    @app.get("/v1/models", tags=["models"], summary="Loaded models (those the caller may read)",
             operation_id="listModels", response_model=rm.ModelList, responses=answers(*READ))
    def list_models(request: Request) -> dict[str, Any]:
        caller = caller_of(request.state)
        return {"models": [describe_model(engine, m.name) for m in engine.models()
                           if caller is None or caller.may_read(m.name)]}

    @app.post("/v1/models", tags=["models"], status_code=201, dependencies=admin,
              summary="Register a model and its tables at runtime", operation_id="registerModel",
              response_model=rm.RegisteredModel, responses=answers(*ADMIN, 400, 404, 409, 422, 503))
    def register_model(model: ModelConfig, replace: bool = False) -> dict[str, Any]:
        if not replace and any(m.name == model.name for m in engine.models()):
            raise HTTPException(409, f"model '{model.name}' is already loaded (pass replace=true to replace it)")
        replicated = ctx.registrations.register(model)
        return {**describe_model(engine, model.name), "replicated": replicated}

    @app.get("/v1/models/{model}", tags=["models"], summary="Describe a model: tables, dims, rows per tier",
             operation_id="getModel", response_model=rm.ModelDescription, responses=answers(*READ, 404))
    def get_model(model: str) -> dict[str, Any]:
        return describe_model(engine, model)

    @app.delete("/v1/models/{model}", tags=["models"], dependencies=admin,
                summary="Unload a model (its rows stay stored)", operation_id="unloadModel",
                response_model=rm.UnloadedModel, responses=answers(*ADMIN, 404, 503))
    def unload_model(model: str) -> dict[str, Any]:
        return {"unloaded": model, "replicated": ctx.registrations.unload(model)}

    add_version_routes(app, engine, ctx.registrations, ctx.readiness, admin)

    add_rows_routes(app, ctx, admin)

    # ---- import jobs ------------------------------------------------------------------------------
    @app.post("/v1/models/{model}/tables/{table}/import", tags=["jobs"], status_code=202, dependencies=admin,
              summary="Import a table from a server-side path or an s3:// URL (npz, Parquet, safetensors, HugeCTR) "
                      "as a background job, streamed", operation_id="importTable",
              response_model=rm.Job, responses=answers(*ADMIN, 400, 404, 409, 422, 503))
    def import_rows(model: str, table: str, body: ImportRequest,
                    model_version: ModelVersion = None) -> dict[str, Any]:
        model = engine.resolve(model, model_version)[0]
        t = engine.table(model, table)
        import_tier(engine)
        if is_s3(body.path):
            parse_s3(body.path)
        else:  # refused now, before a job: a path that is not there, a file that does not parse or has another dim
            check_dim(open_rows(Path(body.path), table), t.id, t.dim)
        job = ctx.jobs.submit("import", {"model": model, "table": table, "path": body.path},
                              import_job(engine, model, table, body.path, body.row_version, ctx.shard_map,
                                         ctx.import_staging))
        return job.view()

    @app.post("/v1/models/{model}/tables/{table}:convert", tags=["jobs"], status_code=202, dependencies=admin,
              summary="Re-encode a table in another row format as a background job, served throughout",
              operation_id="convertTable", response_model=rm.Job, responses=answers(*ADMIN, 400, 404, 409, 422, 503))
    def convert_table(model: str, table: str, body: ConvertRequest) -> dict[str, Any]:
        engine.check_conversion(model, table, body.storage)
        job = ctx.jobs.submit("convert", {"model": model, "table": table, "storage": body.storage},
                              convert_job(engine, model, table, body.storage))
        return job.view()

    @app.post("/v1/models/{model}/tables/{table}/tombstones/purge", tags=["jobs"], status_code=202,
              dependencies=admin, summary="Remove tombstones older than a version from every tier, as a job",
              operation_id="purgeTombstones", response_model=rm.Job, responses=answers(*ADMIN, 400, 404, 422, 503))
    def purge_tombstones(model: str, table: str, body: PurgeTombstonesRequest,
                         wait: Wait = "acknowledged") -> dict[str, Any]:
        engine.table(model, table)
        target = {"model": model, "table": table, "below_version": body.below_version}
        if (writer := ctx.log_writer()) is not None:
            writer.check_admin_messages()  # refused now, not in the job: replicas would drop it unsigned
            job = ctx.jobs.submit("purge_tombstones", target, lambda job: writer.purge_tombstones(
                model, table, body.below_version, wait_applied=wait == "applied"))
        else:
            job = ctx.jobs.submit("purge_tombstones", target,
                                  lambda job: {"purged": engine.purge_tombstones(model, table, body.below_version)})
        return job.view()

    @app.get("/v1/jobs", tags=["jobs"], summary="Known jobs, oldest first", operation_id="listJobs",
             response_model=rm.JobList, responses=answers(*INTERNAL))
    def list_jobs(request: Request) -> dict[str, Any]:
        return {"jobs": visible_jobs([j.view() for j in ctx.jobs.list()], caller_of(request.state))}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], summary="State and progress of a job", operation_id="getJob",
             response_model=rm.Job, responses=answers(*INTERNAL))
    def get_job(job_id: str, request: Request) -> dict[str, Any]:
        return visible_job(ctx.jobs.get(job_id).view(), caller_of(request.state))

    # ---- snapshots --------------------------------------------------------------------------------
    @app.post("/v1/models/{model}/snapshots", tags=["snapshots"], status_code=201, dependencies=admin,
              summary="Checkpoint the persistent store for this model", operation_id="createSnapshot",
              response_model=rm.Snapshot, responses=answers(*ADMIN, 400, 404, 409, 503))
    def create_snapshot(model: str) -> dict[str, Any]:
        return ctx.snapshots.create(model)

    @app.get("/v1/models/{model}/snapshots", tags=["snapshots"], summary="Snapshots of a model",
             operation_id="listSnapshots", response_model=rm.SnapshotList, responses=answers(*READ, 404, 503))
    def list_snapshots(model: str) -> dict[str, Any]:
        engine.model(model)
        return {"snapshots": ctx.snapshots.list(model)}

    @app.get("/v1/models/{model}/snapshots/{snapshot_id}", tags=["snapshots"], summary="One snapshot",
             operation_id="getSnapshot", response_model=rm.Snapshot, responses=answers(*READ, 400, 404, 503))
    def get_snapshot(model: str, snapshot_id: str) -> dict[str, Any]:
        return ctx.snapshots.get(model, snapshot_id)

    @app.delete("/v1/models/{model}/snapshots/{snapshot_id}", tags=["snapshots"], dependencies=admin,
                summary="Delete a snapshot", operation_id="deleteSnapshot", response_model=rm.SnapshotDeleted,
                responses=answers(*ADMIN, 400, 404, 503))
    def delete_snapshot(model: str, snapshot_id: str) -> dict[str, str]:
        ctx.snapshots.delete(model, snapshot_id)
        return {"deleted": snapshot_id}

    @app.post("/v1/models/{model}/snapshots/{snapshot_id}/restore", tags=["snapshots"], status_code=202,
              dependencies=admin, summary="Restore a model's tables from a snapshot (background job)",
              operation_id="restoreSnapshot", response_model=rm.Job, responses=answers(*ADMIN, 400, 404, 409, 503))
    def restore_snapshot(model: str, snapshot_id: str) -> dict[str, Any]:
        ctx.snapshots.check_restorable(model, snapshot_id)
        job = ctx.jobs.submit("restore", {"model": model, "snapshot": snapshot_id},
                              lambda j: ctx.snapshots.restore(model, snapshot_id, j))
        return job.view()

    # ---- stats and cache --------------------------------------------------------------------------
    @app.get("/v1/stats", tags=["stats"], summary="Per model, table and tier: hits, misses, rows, evictions",
             operation_id="getStats", response_model=rm.Stats, responses=answers(*INTERNAL))
    def stats(request: Request) -> dict[str, Any]:
        out = engine.stats()
        out["updates"] = {"enabled": False}
        for name, section in ctx.stats_sections.items():
            out[name] = section()
        return visible_stats(out, caller_of(request.state))

    @app.get("/v1/cache", tags=["cache"], summary="L1 cache stats of every table (the caller may read)",
             operation_id="listCacheStats", response_model=rm.CacheStats, responses=answers(*INTERNAL))
    def cache_stats(request: Request) -> dict[str, Any]:
        models = {m: {"tables": {t: s["cache"] for t, s in entry["tables"].items()}}
                  for m, entry in engine.stats()["models"].items()}  # a table dropped meanwhile is left out
        return {"models": visible_models(models, caller_of(request.state))}

    @app.get("/v1/cache/{model}/{table}", tags=["cache"], summary="L1 cache stats of one table",
             operation_id="getTableCacheStats", response_model=rm.TableCacheStats, responses=answers(*INTERNAL))
    def table_cache_stats(model: str, table: str) -> dict[str, Any]:
        return engine.table_stats(model, table)["cache"]

    @app.post("/v1/cache/{model}/{table}/clear", tags=["cache"], dependencies=admin,
              summary="Drop every row of a table's L1 cache", operation_id="clearCache",
              response_model=rm.CacheCleared, responses=answers(*ADMIN, 404))
    def clear_cache(model: str, table: str) -> dict[str, Any]:
        t = engine.table(model, table)
        if t.cache is None:
            return {"cleared": False, "enabled": False}
        t.cache.clear()
        return {"cleared": True, "enabled": True}

    return app
