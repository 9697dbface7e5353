"""Liveness and readiness, and the probe port that serves them to kubelet.

``/healthz`` answers from the event loop with no work at all, and ``/readyz`` computes readiness on a thread of its
own (a tier's health can mean a round trip to Redis): neither waits for FastAPI's thread pool, which lookups and
body parsing may fill, nor for another request's JSON, so a loaded server is not killed by its liveness probe.

The probe port (``server.probe_port``) is plain HTTP, for probes that cannot speak (mutual) TLS: it serves the same
app as the REST port, marked as the probe listener, so it answers ``/healthz`` and ``/readyz`` and, when
``server.expose_internal_on`` names it, ``/metrics``, ``/docs`` and the stats routes (then on it alone if the REST
port is not named); rows and admin routes never.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from hps_service.server.gatekeeper import Listener
from hps_service.server.http_listener import HttpListener
from hps_service.server.problems import problem
from hps_service.server.rest_models import PUBLIC, Liveness, answers
from hps_service.server.rest_models import Readiness as ReadinessAnswer

#: A readiness check: None when ready, else a short reason naming what is not.
ReadinessCheck = Callable[[], "str | None"]
#: What is not ready (empty when ready), and extra details for the /readyz body (e.g. bootstrap progress).
Readiness = Callable[[], "tuple[list[str], dict[str, Any]]"]
#: Threads that compute readiness, apart from FastAPI's pool.
_READINESS_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hps-readiness")


def readiness_response(readiness: Readiness, models: Callable[[], list[str]]) -> JSONResponse:
    """The /readyz answer: 200 with the models, or 503 naming what is not ready (and details such as bootstrap
    progress)."""
    not_ready, details = readiness()
    if not_ready:
        return problem(503, "not ready: " + "; ".join(not_ready), ready=False, not_ready=not_ready, **details)
    return JSONResponse({"ready": True, "models": models(), **details})


def add_probe_routes(app: FastAPI, readiness: Readiness, models: Callable[[], list[str]]) -> None:
    """``/healthz`` and ``/readyz`` on ``app``, answered without FastAPI's thread pool."""

    @app.get("/healthz", tags=["health"], summary="Liveness: the process answers", operation_id="getLiveness",
             response_model=Liveness, responses=answers(*PUBLIC))
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="Readiness: caught up with the update log, tiers reachable, models "
             "loaded", operation_id="getReadiness", response_model=ReadinessAnswer,
             responses=answers(*PUBLIC, 503))
    async def readyz() -> JSONResponse:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_READINESS_POOL, readiness_response, readiness, models)


class ProbeServer:
    """The probe port: ``app`` (the REST app, starting or full) as the ``probe`` listener, plain HTTP."""

    def __init__(self, host: str, port: int, app: ASGIApp) -> None:
        self._listener = HttpListener(Listener(app, "probe"), host, port, "probe port")
        self.port = self._listener.port

    def close(self) -> None:
        self._listener.close()
