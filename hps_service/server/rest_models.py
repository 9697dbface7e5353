"""The typed answers of the REST API: a pydantic model for each route's 2xx body, the RFC 9457 problem every error
is, and the error codes each route answers (documented as ``application/problem+json``).

Every body is open (``extra="allow"``, ``additionalProperties`` in the spec): its fields here are required and
typed, and a field a route adds before its model names it passes through instead of being dropped (sections a server
grows, such as its tiers' stats, a snapshot store's fields or readiness details, stay open for good). Clients ignore
fields they do not know.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from hps_service.server.problems import PROBLEM_JSON

Source = Literal["unspecified", "cache", "volatile", "persistent", "default", "expired"]


class Open(BaseModel):
    """A body whose fields beyond those typed here pass through."""

    model_config = ConfigDict(extra="allow")


class Problem(Open):
    """An RFC 9457 problem; ``error`` repeats ``detail`` for callers of the earlier ``{"error": ...}`` body, a 422
    adds ``errors`` and a 503 of ``/readyz`` what is not ready."""

    type: str = Field(examples=["about:blank"])
    title: str = Field(examples=["Not Found"])
    status: int = Field(ge=400, le=599, examples=[404])
    detail: str
    error: str


# ---- health -------------------------------------------------------------------------------------
class Liveness(Open):
    status: Literal["ok"]


class Readiness(Open):
    """Ready, the models loaded, and details (``degraded`` tiers, ``bootstrap`` progress)."""

    ready: Literal[True]
    models: list[str]


class ClusterInfo(Open):
    """The shard map, as gRPC's ``GetClusterInfo``."""

    shards: int
    shard: int
    partitions: int
    partitioner: str
    owned_partitions: list[int]
    topic_partitions: dict[str, int]
    ready: bool
    not_ready: list[str]


# ---- models and versions ------------------------------------------------------------------------
class TableDescription(Open):
    name: str
    dim: int
    storage: str
    default: Any = Field(description="the default vector of a key stored nowhere, as configured")
    rows: dict[str, int | None] = Field(description="rows per level (null: the level is off)")


class ModelDescription(Open):
    name: str
    tables: list[TableDescription]
    versions: list[int]
    labels: dict[str, int]
    default_version: int = Field(description="the version a request naming neither version nor label reads")


class ModelList(Open):
    models: list[ModelDescription]


class RegisteredModel(ModelDescription):
    replicated: bool = Field(description="whether the change went through the registration log to every replica")


class UnloadedModel(Open):
    unloaded: str
    replicated: bool


class VersionTable(Open):
    name: str
    dim: int
    storage: str
    rows: int | None = Field(description="rows stored (null: not known here)")
    bytes: int | None = Field(description="bytes stored (null: not known here)")


class VersionDescription(Open):
    version: int
    state: Literal["loading", "ready", "failed", "serving", "draining"] = Field(
        description="ready or serving (a label names it): a label may point at it (see Rollouts)")
    reason: str | None = Field(description="why it is loading or failed")
    source: str | None = Field(description="where its rows came from (a repository's path or URL)")
    ready_at: float | None = Field(description="when it became servable (Unix seconds)")
    tables: list[VersionTable]
    labels: list[str]


class ModelVersion(VersionDescription):
    model: str


class ModelVersions(Open):
    model: str
    default_version: int
    labels: dict[str, int]
    versions: list[VersionDescription]


class AddedVersion(ModelVersions):
    added: int
    replicated: bool


class DroppedVersion(Open):
    model: str
    dropped: int
    replicated: bool


class ModelLabels(Open):
    model: str
    labels: dict[str, int]


class LabelSet(Open):
    model: str
    label: str
    version: int
    before: int | None = Field(description="the version the label named before (null: none)")
    replicated: bool


class LabelRemoved(Open):
    model: str
    label: str
    removed: Literal[True]
    replicated: bool


# ---- rows ---------------------------------------------------------------------------------------
class Embeddings(Open):
    """Rows in the order asked (duplicates included) and the level that answered each key."""

    model: str
    model_version: int = Field(description="the version of the model that answered (0: the model as configured)")
    version: int = Field(description="model_version, as first named")
    table: str
    dim: int
    keys: list[int]
    vectors: list[list[float]]
    sources: list[Source]


class PooledEmbeddings(Open):
    """A pooled lookup's answer: one row per bag, and the deepest level that answered any of its keys."""

    model: str
    model_version: int
    version: int
    table: str
    dim: int
    bags: int
    vectors: list[list[float]]
    sources: list[Source]


class Written(Open):
    model_version: int
    written: int = Field(description="rows written")
    stale: int = Field(description="rows skipped: the stored row of their key is newer")


class Deleted(Open):
    model_version: int
    deleted: int


class Published(Open):
    """With Kafka updates on: what went to the update topic, acknowledged by the broker."""

    model_version: int
    published: int
    topic: str
    offsets: dict[str, int] = Field(description="the offset of the last message per partition")
    applied: Literal[True] | None = Field(None, description="with ?wait=applied: this replica applied them")


# ---- jobs and snapshots -------------------------------------------------------------------------
class Job(Open):
    id: str
    kind: str
    target: dict[str, Any]
    state: Literal["pending", "running", "succeeded", "failed"]
    rows_total: int | None
    rows_done: int
    progress: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    result: dict[str, Any]


class JobList(Open):
    jobs: list[Job]


class Snapshot(Open):
    """A snapshot's record (a local checkpoint's path, or a bucket's size, tables and positions)."""

    id: str
    model: str
    created_at: float


class SnapshotList(Open):
    snapshots: list[Snapshot]


class SnapshotDeleted(Open):
    deleted: str


# ---- stats and cache ----------------------------------------------------------------------------
class Stats(Open):
    """Per model, table and level: hits, misses, hit_rate, rows, capacity, evictions; then node-wide sections
    (``updates``, ``node``, ...) for a caller of every model."""

    models: dict[str, dict[str, Any]]


class CacheStats(Open):
    models: dict[str, dict[str, Any]]


class TableCacheStats(Open):
    enabled: bool


class CacheCleared(Open):
    cleared: bool
    enabled: bool


# ---- errors -------------------------------------------------------------------------------------
#: What each error status means on this API.
MEANINGS: dict[int, str] = {
    400: "a bad argument (named)",
    401: "no credential, or an unknown one (server.auth, or the admin token)",
    403: "a credential that may not do this (another token, a model the reader may not read, the admin API off)",
    404: "no such model, table, version, label, job or snapshot; or a route not served on this port",
    409: "a conflict with the current state (named)",
    413: "over a limit: server.max_batch_keys, or the body's size",
    421: "keys of another shard (naming it)",
    422: "the request does not validate: `errors` lists where",
    503: "not available now: starting, not ready, or a tier or the update log down",
}
#: Codes every route of an access level answers (rest_access): the gatekeeper's.
PUBLIC = (413,)
READ = (401, 403, 413)
ADMIN = (401, 403, 413)
INTERNAL = (401, 403, 404, 413)


def answers(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that answers ``codes`` besides its 2xx, each a problem."""
    return {code: {"description": f"{HTTPStatus(code).phrase}: {MEANINGS[code]}",
                   "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}}
            for code in sorted(set(codes))}


def typed_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` with the Problem schema in its components and without FastAPI's default 422 (its
    ``HTTPValidationError`` body is never answered: a 422 is a problem, documented where a route answers it)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = build()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        for operations in spec["paths"].values():
            for operation in operations.values():
                default = operation.get("responses", {}).get("422", {}).get("content", {})
                if "application/json" in default:
                    del operation["responses"]["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = spec
        return spec

    return openapi
