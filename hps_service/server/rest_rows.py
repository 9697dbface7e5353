"""REST routes of rows: look keys up, put rows, delete keys, in the model version a request names.

One meaning for each number on every surface: ``?model_version=N`` names version N of the model and ``0`` the model
as configured; no ``model_version`` (and no ``label``) means what the label ``production`` names, else the model as
configured, for a read and a write alike, so that a row just put is what the next read naming no version answers.
A row's own version is the body's ``row_version`` (``version``, its first name, is kept as an alias).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from fastapi import FastAPI, Query, Response

from hps_service.engine import as_rows
from hps_service.engine.api import Engine
from hps_service.engine.bags import Bags
from hps_service.errors import FailedPreconditionError, HPSError, InvalidArgumentError, ResourceExhaustedError
from hps_service.server import rest_models as rm
from hps_service.server.rest_bags import body_bags, pooled_answer
from hps_service.server.rest_bodies import Wait, body_schema, json_body, rows_bodies
from hps_service.server.rest_models import ADMIN, READ, answers
from hps_service.server.status import status_for

if TYPE_CHECKING:
    from hps_service.server.rest import AdminContext

_SOURCE_NAMES = np.array(["unspecified", "cache", "volatile", "persistent", "default", "expired"])
#: ``?model_version=N``: version N of the model (``POST /v1/models/{model}/versions``), 0 the model as configured;
#: absent: the version its ``?label=`` (a read) or its label ``production`` names, else the model as configured.
#: Not a row's version: that is the body's ``row_version``.
ModelVersion = Annotated[int | None, Query(ge=0, le=2**31 - 1, description=(
    "a version of the model; 0: the model as configured; absent: what ?label= (or the label production) names, "
    "else the model as configured"))]
#: ``?strict=true``: a put with a row older than the stored one is refused (409) and nothing is written.
Strict = Annotated[bool, Query(description="refuse the whole put with 409 when a row is older than the one stored "
                                           "for its key (default: such rows are skipped and counted as stale)")]
_DECIMAL = re.compile(r"[+-]?[0-9]+")


def parse_keys(text: str) -> np.ndarray:
    """``"1,2,3"`` as an int64 array; InvalidArgumentError naming the bad entry."""
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    bad = next((p for p in parts if not _DECIMAL.fullmatch(p)), None)
    if bad is not None:  # ASCII decimals only: int() would also take '1_0' or other scripts' digits
        raise InvalidArgumentError(f"keys must be comma-separated integers, got {bad!r}")
    values = [int(p) for p in parts]
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise InvalidArgumentError("keys must fit in int64") from None


def rows_array(vectors: list[list[float]], n: int) -> np.ndarray:
    """JSON rows as a float32 (n, dim) array; ragged rows are an InvalidArgumentError."""
    if n == 0 and not vectors:
        return np.zeros((0, 0), dtype=np.float32)
    try:
        with np.errstate(over="ignore"):  # out-of-range values become inf and are rejected by the engine
            return np.asarray(vectors, dtype=np.float32)
    except ValueError:
        raise InvalidArgumentError("vectors must be a list of rows of equal length") from None


def add_rows_routes(app: FastAPI, ctx: AdminContext, admin: Sequence[Any]) -> None:
    """Register the rows routes on ``app`` (``admin``: the dependencies of an admin route)."""
    engine, cfg = ctx.engine, ctx.config.server
    bodies = rows_bodies(cfg.max_batch_keys)
    rows_path = "/v1/models/{model}/tables/{table}/embeddings"

    def check_batch(n: int, what: str) -> None:
        if n > cfg.max_batch_keys:
            raise ResourceExhaustedError(f"{n} {what} in one request exceeds server.max_batch_keys={cfg.max_batch_keys}")

    def rows_of(method: str, model: str, table: str, keys: Callable[[], np.ndarray], version: int | None,
                label: str, bags: Callable[[int], Bags | None] = lambda n: None) -> Response:
        """Look ``keys()`` up in the version ``version`` or ``label`` names, timed and counted as ``method``; the
        rows as JSON (encoded once, not walked by FastAPI's encoder: a 65,536 x 64 answer is 4M floats). With
        ``bags(n)`` naming bags of the n keys, a pooled lookup: one row per bag."""
        with ctx.metrics.observe(method) as outcome:
            try:
                served, version = engine.resolve(model, version, label)
                arr = keys()
                check_batch(arr.shape[0], "keys")
                pooled = bags(arr.shape[0])
                ctx.shard_map.check(arr)
                if pooled is not None:
                    outcome[1] = True
                    ctx.metrics.observe_bags(pooled.count)
                    body = pooled_answer(engine, served, model, version, table, arr, pooled, _SOURCE_NAMES)
                else:
                    result = engine.lookup(served, table, arr)
            except HPSError as err:
                outcome[0] = status_for(err).name
                raise
            ctx.metrics.observe_keys(arr.shape[0])
        if pooled is None:
            body = {"model": model, "model_version": version, "version": version, "table": table,
                    "dim": int(result.vectors.shape[1]), "keys": arr.tolist(), "vectors": result.vectors.tolist(),
                    "sources": _SOURCE_NAMES[result.sources].tolist()}
        return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")

    read_errors = answers(*READ, 400, 404, 413, 421, 422, 503)
    get_responses: dict[int | str, dict[str, Any]] = {200: {"description": (
        "rows in the order asked: `{model, model_version, table, dim, keys, vectors, sources}` (`version`: "
        "model_version, as first named)"), "model": rm.Embeddings}, **read_errors}
    lookup_responses: dict[int | str, dict[str, Any]] = {200: {"description": (
        "rows in the order asked, as the GET's; a pooled lookup's, one per bag: `{model, model_version, table, dim, "
        "bags, vectors, sources}`"), "model": rm.Embeddings | rm.PooledEmbeddings}, **read_errors}

    @app.get(rows_path, tags=["rows"], summary="Rows of keys, and which level answered each",
             response_class=Response, responses=get_responses, operation_id="getEmbeddings")
    def get_rows(model: str, table: str,
                 keys: str = Query(..., description="comma-separated int64 keys (a few thousand at most: the URL is "
                                                    "limited; POST ...embeddings:lookup takes up to "
                                                    "server.max_batch_keys)", examples=["1,2,3"]),
                 model_version: ModelVersion = None, label: str = "") -> Response:
        return rows_of("RestGetEmbeddings", model, table, lambda: parse_keys(keys), model_version, label)

    @app.post(rows_path + ":lookup", tags=["rows"], response_class=Response, responses=lookup_responses,
              operation_id="lookupEmbeddings",
              summary="Rows of many keys (JSON body, up to server.max_batch_keys), and which level answered each; "
                      "with offsets and a combiner, one row per bag",
              openapi_extra=body_schema(bodies.lookup))
    def lookup_rows(model: str, table: str, body: Any = json_body(bodies.lookup, cfg.max_batch_keys),
                    model_version: ModelVersion = None, label: str = "") -> Response:
        return rows_of("RestLookupEmbeddings", model, table, lambda: np.array(body.keys, dtype=np.int64),
                       model_version, label, lambda n: body_bags(body, n, cfg.max_batch_keys))

    @app.put(rows_path, tags=["rows"], dependencies=admin, openapi_extra=body_schema(bodies.put),
             summary="Upsert rows (dim checked, NaN/inf rejected): how many were written, how many were stale",
             operation_id="putEmbeddings", response_model=rm.Written | rm.Published, response_model_exclude_none=True,
             responses=answers(*ADMIN, 400, 404, 409, 413, 421, 422, 503))
    def put_rows(model: str, table: str, body: Any = json_body(bodies.put, cfg.max_batch_keys),
                 wait: Wait = "acknowledged", model_version: ModelVersion = None,
                 strict: Strict = False) -> dict[str, Any]:
        served, version = engine.resolve(model, model_version)
        n = len(body.keys)
        check_batch(n, "rows")
        t = engine.table(served, table)
        vectors = rows_array(body.vectors, n)
        if n == 0 and vectors.size == 0:
            return {"model_version": version, "written": 0, "stale": 0}
        keys = np.array(body.keys, dtype=np.int64)
        ctx.shard_map.check(keys)
        if vectors.ndim != 2 or vectors.shape[1] != t.dim:
            width = vectors.shape[1] if vectors.ndim == 2 else "?"
            raise InvalidArgumentError(f"table '{table}' has dim {t.dim}; rows have {width} values")
        if (writer := ctx.log_writer()) is not None:
            as_rows(vectors, n, t.dim, f"rows for {served}.{table}")
            if strict:
                refuse_stale_here(engine, served, table, keys, body.row_version)
            return {"model_version": version,
                    **writer.put(served, table, keys, vectors, body.row_version, wait_applied=wait == "applied")}
        counts = engine.put_rows(served, table, keys, vectors, body.row_version, strict=strict)
        return {"model_version": version, "written": counts.written, "stale": counts.stale}

    @app.delete(rows_path, tags=["rows"], dependencies=admin, summary="Delete rows from every tier",
                openapi_extra=body_schema(bodies.delete), operation_id="deleteEmbeddings",
                response_model=rm.Deleted | rm.Published, response_model_exclude_none=True,
                responses=answers(*ADMIN, 400, 404, 413, 421, 422, 503))
    def delete_rows(model: str, table: str, body: Any = json_body(bodies.delete, cfg.max_batch_keys),
                    wait: Wait = "acknowledged", model_version: ModelVersion = None) -> dict[str, Any]:
        served, version = engine.resolve(model, model_version)
        check_batch(len(body.keys), "keys")
        keys = np.array(body.keys, dtype=np.int64)
        ctx.shard_map.check(keys)
        if (writer := ctx.log_writer()) is not None:
            return {"model_version": version,
                    **writer.delete(served, table, keys, body.row_version, wait_applied=wait == "applied")}
        return {"model_version": version, "deleted": engine.apply_deletes(served, table, keys, body.row_version)}


def refuse_stale_here(engine: Engine, served: str, table: str, keys: np.ndarray, row_version: int) -> None:
    """A strict put through the update log: refused (409) when this replica stores a newer row for one of its keys
    (checked here before it is published; the replicas apply it later, each skipping what is stale there)."""
    t = engine.table(served, table)
    tier = engine.persistent if engine.persistent is not None else engine.volatile
    if tier is None:
        return
    uniq = np.unique(keys)
    stale = np.flatnonzero(~tier.accepts(t.id, uniq, np.full(uniq.shape[0], row_version, np.int64)))
    if stale.size:
        raise FailedPreconditionError(f"{stale.size} of {uniq.shape[0]} rows are older than the rows this replica "
                                      f"stores for their keys (key {int(uniq[stale[0]])}, for one); nothing was "
                                      "published (strict)")
