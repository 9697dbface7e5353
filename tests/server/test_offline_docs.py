"""/docs and /redoc of a real server come from packaged assets: the pages name no outside URL, the assets are
served, and headless Chromium (Debian's, `make test-deps`) with every host but the server's unresolvable renders
Swagger UI with the lookup operation in it (a screenshot is saved in the test's tmp directory)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from hps_service.serve.process import HPSServer
from tests.server.conftest import base_url

OUTSIDE = re.compile(r"""(?:src|href)=["'](?:https?:)?//""")


def test_docs_pages_load_only_local_assets(server: HPSServer, http: httpx.Client) -> None:
    for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = http.get(page).text
        assert not OUTSIDE.search(html), f"{page} loads something from outside: {OUTSIDE.findall(html)}"
        (url,) = re.findall(rf"""["']([^"']*{asset})["']""", html)
        got = http.get(url)
        assert got.status_code == 200 and len(got.content) > 100_000, (url, got.status_code)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _headless(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium headless, offline but for loopback: every other host name fails to resolve."""
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                           "--virtual-time-budget=15000", *args], capture_output=True, text=True, timeout=120)


def test_swagger_ui_renders_offline_in_headless_chromium(server: HPSServer, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.fail("chromium is missing: `make test-deps` installs Debian's chromium")
    shot = tmp_path / "docs.png"
    # one run (the browser's start is most of its time): the rendered DOM on stdout, and the screenshot
    done = _headless(browser, tmp_path / "profile", "--dump-dom", f"--screenshot={shot}", "--window-size=1280,1600",
                     f"{base_url(server)}/docs")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "opblock" in done.stdout, "Swagger UI did not render its operations"
    assert "/v1/models/{model}/tables/{table}/embeddings:lookup" in done.stdout
    assert shot.stat().st_size > 10_000, done.stderr[-2000:]
    print(f"\nscreenshot: {shot}")
