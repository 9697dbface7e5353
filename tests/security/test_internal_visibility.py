"""A reader restricted to some models sees only those through the internal routes (issue 57: /v1/stats, /v1/cache
and /metrics showed it every model): /v1/stats and /v1/cache list its models alone, another model's cache and jobs
are refused or not found, and /metrics, which spans every model, is refused it. A reader of every model sees all."""

from __future__ import annotations

from pathlib import Path

import httpx

from hps_service.config import load_config
from tests.helpers import free_port
from tests.server.conftest import running, wait_job

ADMIN = "visibility-admin-token-0001"
RANKER = "visibility-ranker-token-0001"
OPS = "visibility-ops-token-000001"


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_internal_routes_show_a_reader_its_models_only(tmp_path: Path) -> None:
    config = load_config(
        None, server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "workers": 0,
                      "grpc_workers": 2, "admin_token": ADMIN, "auth": "token",
                      "readers": [{"name": "ranker", "token": RANKER, "models": ["demo"]},
                                  {"name": "ops", "token": OPS, "models": ["*"]}]},
        cache={"backend": "numpy", "capacity": 64}, persistent={"type": "rocksdb", "path": str(tmp_path / "db")},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": 2}]},
                {"name": "other", "tables": [{"name": "item", "dim": 2}]}])
    with running(config) as srv, httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=30) as http, \
            httpx.Client(base_url=http.base_url, headers=_as(ADMIN), timeout=30) as admin:
        job = admin.post("/v1/models/other/tables/item:convert", json={"storage": "fp16"})
        assert job.status_code == 202, job.text
        assert wait_job(admin, job.json()["id"])["state"] == "succeeded"

        ranker = _as(RANKER)
        stats = http.get("/v1/stats", headers=ranker).json()
        assert set(stats) == {"models"} and set(stats["models"]) == {"demo"}, stats.keys()
        assert set(http.get("/v1/cache", headers=ranker).json()["models"]) == {"demo"}
        assert http.get("/v1/cache/demo/item", headers=ranker).status_code == 200
        refused = http.get("/v1/cache/other/item", headers=ranker)
        assert refused.status_code == 403 and "may not read model 'other'" in refused.json()["detail"]
        assert http.get("/v1/jobs", headers=ranker).json() == {"jobs": []}
        assert http.get(f"/v1/jobs/{job.json()['id']}", headers=ranker).status_code == 404
        metrics = http.get("/metrics", headers=ranker)
        assert metrics.status_code == 403 and "models: ['*']" in metrics.json()["detail"], metrics.text

        ops = _as(OPS)
        stats = http.get("/v1/stats", headers=ops).json()
        assert set(stats["models"]) == {"demo", "other"} and "updates" in stats
        assert set(http.get("/v1/cache", headers=ops).json()["models"]) == {"demo", "other"}
        assert [j["id"] for j in http.get("/v1/jobs", headers=ops).json()["jobs"]] == [job.json()["id"]]
        scraped = http.get("/metrics", headers=ops)
        assert scraped.status_code == 200 and 'model="other"' in scraped.text
