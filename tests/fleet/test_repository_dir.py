"""The model repository in a directory (issue 53, part 3), against a real in-process server: a file still being
written is not read; only the keep_versions newest versions are imported; entries outside the layout, and a link
out of the repository, are never read; what an interrupted import left is freed before the version is imported
again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_client import HPSClient
from hps_service.admin.importer import synthesize_model
from hps_service.config import HPSConfig, load_config
from hps_service.serve.process import HPSServer
from tests.helpers import free_port, run_hps, write_config
from tests.server.conftest import running
from tests.updates.conftest import wait_until

DIM = 8
KEYS, ROWS = synthesize_model(4_000, DIM, seed=41)


def _config(tmp: Path, poll_s: float = 0.3) -> dict:
    return {"server": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "workers": 0},
            "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
            "repository": {"url": str(tmp / "repo"), "poll_s": poll_s},
            "models": [{"name": "m", "keep_versions": 2, "tables": [{"name": "t", "dim": DIM}]}]}


def _states(http: httpx.Client) -> dict[int, dict]:
    return {v["version"]: v for v in http.get("/v1/models/m/versions").json()["versions"]}


def _write(repo: Path, version: int, scale: float = 1.0) -> Path:
    where = repo / "m" / str(version)
    where.mkdir(parents=True, exist_ok=True)
    np.savez(where / "t.npz", keys=KEYS, vectors=ROWS * np.float32(scale))
    return where / "t.npz"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[HPSServer, httpx.Client, Path]]:
    (tmp_path / "repo").mkdir()
    cfg: HPSConfig = load_config(None, **_config(tmp_path, poll_s=1.0))
    with running(cfg) as srv, httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=30) as http:
        yield srv, http, tmp_path / "repo"


def test_a_file_being_written_is_not_read_until_it_stops_changing(served) -> None:  # noqa: ANN001
    _, http, repo = served
    whole = _write(repo, 1).read_bytes()
    target = repo / "m" / "2" / "t.npz"
    target.parent.mkdir(parents=True)
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            state = _states(http).get(2, {}).get("state")
            if state:
                seen.add(state)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with open(target, "wb") as f:  # written for 3 s, well past several listings, a piece every 0.1 s
            pieces = 30
            for i in range(pieces):
                f.write(whole[i * len(whole) // pieces:(i + 1) * len(whole) // pieces])
                f.flush()
                time.sleep(0.1)
        assert wait_until(lambda: _states(http).get(2, {}).get("state") == "ready", timeout=30), _states(http)
    finally:
        done.set()
        watcher.join()
    assert "failed" not in seen, seen
    assert _states(http)[2]["tables"][0]["rows"] == KEYS.size


def test_the_newest_versions_are_imported_and_entries_outside_the_layout_are_never_read(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for version in (1, 2, 3, 4):
        _write(repo, version, version)
    outside = tmp_path / "outside"
    outside.mkdir()
    np.savez(outside / "t.npz", keys=KEYS, vectors=ROWS)
    (repo / "m" / "5").mkdir()
    (repo / "m" / "5" / "t.npz").symlink_to(outside / "t.npz")  # a link out of the repository: not followed
    (repo / "m" / "5" / "notes.txt").write_text("trained on the week of 3 May")
    for odd in ("07", "0", "x", "99999999999", "../m"):  # not version numbers: never read
        (repo / "m" / odd).mkdir(exist_ok=True)
        np.savez(repo / "m" / odd / "t.npz", keys=KEYS, vectors=ROWS)
    (repo / "no model!" / "1").mkdir(parents=True)
    np.savez(repo / "no model!" / "1" / "t.npz", keys=KEYS, vectors=ROWS)
    (repo / "other" / "1").mkdir(parents=True)  # a model this server does not serve
    np.savez(repo / "other" / "1" / "t.npz", keys=KEYS, vectors=ROWS)
    with running(load_config(None, **_config(tmp_path))) as srv, \
            httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=30) as http:
        assert wait_until(lambda: _states(http).get(5, {}).get("state") == "failed", timeout=30), _states(http)
        assert "no file for table(s) t" in _states(http)[5]["reason"]
        assert wait_until(lambda: _states(http).get(4, {}).get("state") == "ready", timeout=30), _states(http)
        # keep_versions 2: of 1..5 the newest two (4, and 5, which failed) are imported
        assert sorted(_states(http)) == [4, 5], _states(http)
        stats = http.get("/v1/stats").json()["repository"]
        assert stats["ignored_entries"] >= 5 and stats["last_error"] is None, stats
        with HPSClient(f"127.0.0.1:{srv.grpc_port}") as client:
            np.testing.assert_array_equal(client.lookup("m", "t", KEYS[:100], version=4), ROWS[:100] * 4)


def test_what_an_interrupted_import_left_is_freed_before_the_version_is_imported(tmp_path: Path) -> None:
    """Rows under the version's tier ids that no registration serves (an import a stop cut short; here written
    by hps import before the start) are dropped, and the version then holds the repository's rows alone."""
    data = _config(tmp_path)
    cfg = write_config(tmp_path / "hps.yaml", data)
    stray_keys = np.arange(10**9, 10**9 + 500, dtype=np.int64)
    np.savez(tmp_path / "stray.npz", keys=stray_keys, vectors=np.full((500, DIM), 9.0, np.float32))
    done = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "t", "--model-version", "3",
                   str(tmp_path / "stray.npz"))
    assert done.returncode == 0, done.stderr
    (tmp_path / "repo").mkdir()
    _write(tmp_path / "repo", 3, 3.0)
    with running(load_config(cfg)) as srv, httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}") as http:
        assert wait_until(lambda: _states(http).get(3, {}).get("state") == "ready", timeout=30), _states(http)
        assert _states(http)[3]["tables"][0]["rows"] == KEYS.size
        with HPSClient(f"127.0.0.1:{srv.grpc_port}") as client:
            assert not client.lookup("m", "t", stray_keys[:5], version=3).any()
            np.testing.assert_array_equal(client.lookup("m", "t", KEYS[:50], version=3), ROWS[:50] * 3)
