"""What the internal routes show a caller restricted to some models (``server.readers[].models``): its models and
nothing of the others. A caller of every model, the admin, and any caller where no credential is needed (auth none,
the probe port) see everything.

* ``/v1/stats``: the models it may read (each version under its model), and none of the node-wide sections (the
  update consumer's topics and offsets, the registration log, the node): they name every model.
* ``/v1/cache``: the models it may read; ``/v1/cache/{model}/{table}`` of another model is refused by the
  gatekeeper, as a read of that model is.
* ``/v1/jobs``: the jobs of the models it may read; another model's job is not found.
* ``/metrics``: refused (403). Its series span every model, and beside the per-model labels the update consumer's
  series name topics, which name models; a filtered exposition would be a second, partial view of one scrape
  target. Prometheus scrapes with a reader of every model (``models: ["*"]``) or on the probe port.
"""

from __future__ import annotations

from typing import Any

from hps_service.config.base import split_served
from hps_service.errors import NotFoundError, PermissionDeniedError
from hps_service.server.auth import Principal


def restricted(caller: Principal | None) -> bool:
    """Whether ``caller`` may read only some models."""
    return caller is not None and caller.models is not None


def _readable(caller: Principal | None, served: str) -> bool:
    return caller is None or caller.may_read(split_served(served)[0])


def visible_stats(stats: dict[str, Any], caller: Principal | None) -> dict[str, Any]:
    """``/v1/stats`` as ``caller`` may see it."""
    if not restricted(caller):
        return stats
    return {"models": {m: v for m, v in stats.get("models", {}).items() if _readable(caller, m)}}


def visible_models(models: dict[str, Any], caller: Principal | None) -> dict[str, Any]:
    """A ``{model: ...}`` map (``/v1/cache``) without the models ``caller`` may not read."""
    return {m: v for m, v in models.items() if _readable(caller, m)}


def visible_jobs(jobs: list[dict[str, Any]], caller: Principal | None) -> list[dict[str, Any]]:
    """Job views (``/v1/jobs``) of the models ``caller`` may read."""
    return [job for job in jobs if _readable(caller, str(job.get("target", {}).get("model", "")))]


def visible_job(job: dict[str, Any], caller: Principal | None) -> dict[str, Any]:
    """One job view; NotFoundError (as for an unknown id) when it is another model's."""
    if not _readable(caller, str(job.get("target", {}).get("model", ""))):
        raise NotFoundError(f"no job '{job.get('id')}'")
    return job


def check_metrics(caller: Principal | None) -> None:
    """PermissionDeniedError for a caller restricted to some models (see the module docstring)."""
    if restricted(caller):
        assert caller is not None
        raise PermissionDeniedError(
            f"reader '{caller.name}' may read only some models, and /metrics spans every model: scrape it with a "
            "reader of every model (models: ['*']) or on the probe port (server.expose_internal_on)")
