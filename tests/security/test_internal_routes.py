"""Which REST routes each port serves: with ``server.expose_internal_on: [probe]``, /metrics, /docs, the OpenAPI,
/v1/stats, /v1/jobs and /v1/cache are on the plaintext probe port alone (the REST port answers 404), and the probe port
never serves rows or admin routes. Every route of the app has an explicit entry in the access table."""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi.routing import APIRoute

from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from hps_service.server.rest_access import ROUTES
from tests.helpers import free_port

ADMIN = "internal-routes-admin-token"


def test_internal_routes_on_the_probe_port_only(tmp_path: Path) -> None:
    probe_port = free_port()
    srv = HPSServer(load_config(
        None, server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "workers": 0,
                      "grpc_workers": 2, "admin_token": ADMIN, "probe_port": probe_port,
                      "expose_internal_on": ["probe"]},
        cache={"backend": "numpy", "capacity": 64}, persistent={"type": "rocksdb", "path": str(tmp_path / "db")},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": 2}]}]))
    srv.start()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    internal = ["/metrics", "/docs", "/openapi.json", "/v1/stats", "/v1/jobs", "/v1/cache", "/v1/cache/demo/item"]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=10) as rest, \
                httpx.Client(base_url=f"http://127.0.0.1:{probe_port}", timeout=10) as probe:
            for path in internal:
                hidden = rest.get(path, headers=admin)
                assert hidden.status_code == 404 and "not served on this port" in hidden.json()["error"], path
                assert probe.get(path).status_code == 200, path
            assert "hps_lookup" in probe.get("/metrics").text
            for client in (rest, probe):
                assert client.get("/healthz").json() == {"status": "ok"}
                assert client.get("/readyz").json()["ready"] is True
            rows = "/v1/models/demo/tables/item/embeddings"
            assert rest.get(rows, params={"keys": "1"}).status_code == 200
            assert rest.put(rows, json={"keys": [1], "vectors": [[1, 2]]}, headers=admin).status_code == 200
            for method, path in (("GET", rows + "?keys=1"), ("PUT", rows), ("GET", "/v1/models"),
                                 ("POST", "/v1/cache/demo/item/clear")):
                refused = probe.request(method, path, headers=admin, json={"keys": [1], "vectors": [[1, 2]]})
                assert refused.status_code == 404, (method, path, refused.text)
        # A route added without an entry would fall to a default (internal or admin, never public): each is named,
        # and the admin ones are exactly those FastAPI checks the admin token on as well.
        app = srv._app.target
        names = {route.name for route in app.router.routes}
        assert names == set(ROUTES), (names - set(ROUTES), set(ROUTES) - names)
        guarded = {route.name for route in app.router.routes if isinstance(route, APIRoute)
                   and any(dep.dependency.__name__ == "require_admin" for dep in route.dependencies)}
        assert guarded == {name for name, (access, _) in ROUTES.items() if access == "admin"}
    finally:
        srv.stop(grace=1)
