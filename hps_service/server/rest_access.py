"""Who may call each REST route, on which port, and how large a body it takes: the table the gatekeeper reads
(by the route's endpoint name) before one byte of a body is read.

* ``public``: liveness and readiness, on every port, to anyone.
* ``read``: models and rows; with ``server.auth`` token or mtls a reader's credential (and the model allowed).
* ``admin``: every mutating route; the admin token.
* ``internal``: metrics, docs, stats, jobs, cache stats: on the ports ``server.expose_internal_on`` names; on the
  REST port a read credential when ``server.auth`` is on, on the probe port nothing (keep that port in-cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hps_service.server.rest_bodies import bags_body_bytes, keys_body_bytes, rows_body_bytes

Access = Literal["public", "read", "admin", "internal"]
#: What a route's body holds: nothing (a small allowance for clients that send ``{}``), a small JSON object, a model
#: config, keys (a delete), keys in bags (a lookup, plain or pooled), or rows (a put; bounded by the table's dim).
BodyKind = Literal["none", "small", "model", "keys", "bags", "rows"]
NO_BODY_BYTES, SMALL_BODY_BYTES, MODEL_BODY_BYTES = 4 << 10, 64 << 10, 1 << 20

ROUTES: dict[str, tuple[Access, BodyKind]] = {
    "healthz": ("public", "none"),
    "readyz": ("public", "none"),
    "metrics": ("internal", "none"),
    "openapi": ("internal", "none"),
    "swagger_ui_html": ("internal", "none"),
    "redoc_html": ("internal", "none"),
    "docs-assets": ("internal", "none"),
    "stats": ("internal", "none"),
    "cache_stats": ("internal", "none"),
    "table_cache_stats": ("internal", "none"),
    "list_jobs": ("internal", "none"),
    "get_job": ("internal", "none"),
    "cluster": ("read", "none"),
    "list_models": ("read", "none"),
    "get_model": ("read", "none"),
    "get_rows": ("read", "none"),
    "lookup_rows": ("read", "bags"),
    "list_snapshots": ("read", "none"),
    "get_snapshot": ("read", "none"),
    "register_model": ("admin", "model"),
    "unload_model": ("admin", "none"),
    "put_rows": ("admin", "rows"),
    "delete_rows": ("admin", "keys"),
    "import_rows": ("admin", "small"),
    "purge_tombstones": ("admin", "small"),
    "convert_table": ("admin", "small"),
    "create_snapshot": ("admin", "none"),
    "delete_snapshot": ("admin", "none"),
    "restore_snapshot": ("admin", "none"),
    "clear_cache": ("admin", "none"),
    "list_versions": ("read", "none"),
    "get_version": ("read", "none"),
    "list_labels": ("read", "none"),
    "create_version": ("admin", "model"),
    "delete_version": ("admin", "none"),
    "set_label": ("admin", "small"),
    "delete_label": ("admin", "none"),
}
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class RoutePolicy:
    access: Access
    body: BodyKind


def policy_of(name: str, method: str) -> RoutePolicy:
    """The policy of route ``name``; a route not in the table (added without one) is internal when it only reads,
    admin when it may change something: never public by omission."""
    access, body = ROUTES.get(name, ("internal" if method in _SAFE_METHODS else "admin", "small"))
    return RoutePolicy(access, body)


class BodyLimits:
    """The byte bound of a route's body, from server.max_batch_keys and the table's dim, at most
    server.max_body_bytes."""

    def __init__(self, max_batch_keys: int, max_body_bytes: int, dim_of: Callable[[str, str], int | None]) -> None:
        """``dim_of(model, table)``: the table's dim, None when there is no such table (its body is then bounded as
        one of dim 1: the endpoint answers 404 for it)."""
        self.max_batch_keys = max_batch_keys
        self.max_body_bytes = max_body_bytes
        self.dim_of = dim_of

    def bound(self, kind: BodyKind, params: dict[str, str]) -> int:
        if kind == "keys":
            limit = keys_body_bytes(self.max_batch_keys)
        elif kind == "bags":
            limit = bags_body_bytes(self.max_batch_keys)
        elif kind == "rows":
            dim = self.dim_of(params.get("model", ""), params.get("table", "")) or 1
            limit = rows_body_bytes(self.max_batch_keys, dim)
        else:
            limit = {"none": NO_BODY_BYTES, "small": SMALL_BODY_BYTES, "model": MODEL_BODY_BYTES}[kind]
        return min(limit, self.max_body_bytes)

    @staticmethod
    def describe(kind: BodyKind) -> str:
        """How a route's bound is made, for the 413's message."""
        if kind == "keys":
            return "server.max_batch_keys keys"
        if kind == "rows":
            return "server.max_batch_keys rows of the table's dim"
        return "this route"
