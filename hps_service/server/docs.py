"""/docs (Swagger UI) and /redoc of the admin API from assets packaged with the server (the ``fastapi-offline``
distribution ships swagger-ui-bundle.js, its CSS and redoc.standalone.js), so an offline cluster shows them: FastAPI's
own pages load the same files from a CDN."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

#: Where the packaged assets are served.
ASSETS = "/docs-assets"
_STATIC = Path(fastapi_offline.__file__).resolve().parent / "static"


def add_offline_docs(app: FastAPI) -> None:
    """Serve /docs and /redoc for ``app`` (created with ``docs_url=None, redoc_url=None``) from local assets."""
    app.mount(ASSETS, StaticFiles(directory=_STATIC), name="docs-assets")
    title = f"{app.title} - docs"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui_html() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=title,
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    def redoc_html() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url or "/openapi.json", title=title,
                              redoc_js_url=f"{ASSETS}/redoc.standalone.js", redoc_favicon_url=f"{ASSETS}/favicon.png",
                              with_google_fonts=False)
