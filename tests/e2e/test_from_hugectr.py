"""A HugeCTR HPS user's migration (issue 55): ``hps config from-hugectr ps.json --import`` on HPS-shaped configurations
(tests/fixtures/hugectr) writes a config and imports the HugeCTR sparse model files the ps.json names; ``hps serve``
of that config answers every imported row, and each table's default for the keys it does not hold. With a Redis
Cluster volatile_db the converted config serves through the cluster; with a Kafka update_source it follows the
model's update topic."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from hps_service.admin.importer import write_hugectr_dir
from hps_service.client import HPSClient
from hps_service.updates import Publisher, make_version
from tests.helpers import REPO, ServerProcess, free_port, run_hps

FIXTURES = REPO / "tests" / "fixtures" / "hugectr"
ROWS = 3000


def _migrate(fixture: str, tmp_path: Path, patch: Callable[[dict], None] | None = None) -> tuple[Path, dict, dict]:
    """The ps.json (patched), its sparse files written where it names them, converted with --import; returns the
    config written, the ps.json and each (model, table) -> (keys, rows, dim, default)."""
    ps = json.loads((FIXTURES / fixture).read_text())
    if patch is not None:
        patch(ps)
    (tmp_path / "ps.json").write_text(json.dumps(ps))
    rng = np.random.default_rng(55)
    tables = {}
    for m in ps["models"]:
        names = m.get("embedding_table_names") or [f"sparse_embedding{j + 1}" for j in
                                                   range(len(m["embedding_vecsize_per_table"]))]
        for j, (name, dim) in enumerate(zip(names, m["embedding_vecsize_per_table"])):
            keys = rng.choice(2**40, size=ROWS, replace=False).astype(np.int64)
            rows = rng.standard_normal((ROWS, int(dim))).astype(np.float32)
            write_hugectr_dir(tmp_path / m["sparse_files"][j], keys, rows)
            tables[(m["model"], name)] = (keys, rows, int(dim), float(m["default_value_for_each_table"][j]))
    config = tmp_path / "hps.yaml"
    done = run_hps("config", "from-hugectr", str(tmp_path / "ps.json"), "--out", str(config),
                   "--rocksdb", str(tmp_path / "db"), "--import", timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(f"imported {ROWS} rows") == len(tables), done.stderr
    return config, ps, tables


ADMIN_TOKEN = "hugectr-admin-token-0001"


def _server(config: Path) -> tuple[ServerProcess, str]:
    """``hps serve`` of the converted config on free ports (one worker process), not started yet; and its REST URL."""
    grpc_port, http_port = free_port(), free_port()
    env = {"HPS_SERVER__GRPC_PORT": str(grpc_port), "HPS_SERVER__HTTP_PORT": str(http_port),
           "HPS_SERVER__WORKERS": "1", "HPS_ADMIN_TOKEN": ADMIN_TOKEN}
    return ServerProcess(config, grpc_port, env=env), f"http://127.0.0.1:{http_port}"


def _check_rows(client: HPSClient, tables: dict) -> None:
    """Every table answers its imported rows, and its default for keys it does not hold."""
    for (model, table), (keys, rows, dim, default) in tables.items():
        got = client.lookup(model, table, keys)
        np.testing.assert_array_equal(got, rows, err_msg=f"{model}.{table}")
        absent = np.setdiff1d(np.arange(1, 50, dtype=np.int64), keys)
        answer = client.lookup_with_sources(model, table, absent)
        assert set(answer.sources) == {4}, (model, table)
        np.testing.assert_array_equal(answer.vectors, np.full((absent.size, dim), default, np.float32))


def test_a_single_model_ps_json_serves_its_imported_sparse_files(tmp_path: Path) -> None:
    config, _, tables = _migrate("wdl_single_model.json", tmp_path)
    srv, _ = _server(config)
    with srv, HPSClient(srv.target) as client:
        _check_rows(client, tables)
        assert srv.stop() == 0


def test_a_multi_model_ps_json_with_a_redis_cluster_serves_through_the_cluster(redis_cluster_clean,
                                                                               tmp_path: Path) -> None:
    def use_the_fixture(ps: dict) -> None:
        ps["volatile_db"]["address"] = ",".join(redis_cluster_clean.nodes)

    config, _, tables = _migrate("multi_model_redis_cluster.json", tmp_path, use_the_fixture)
    srv, http = _server(config)
    with srv, HPSClient(srv.target) as client:
        _check_rows(client, tables)
        keys = tables[("ranker", "sparse_embedding0")][0]
        # the rows the worker read from RocksDB are offered to the owner, which promotes them into the cluster in
        # the background; a promotion is best effort (an offer the busy owner cannot take, a write past the
        # cluster's socket timeout, is dropped), and once L1 holds a row no read goes below it to offer it again:
        # L1 is cleared so that the next read does
        def volatile() -> dict:
            stats = httpx.get(f"{http}/v1/stats", timeout=5).json()
            return stats["models"]["ranker"]["tables"]["sparse_embedding0"]["volatile"]

        deadline = time.monotonic() + 30
        while volatile()["rows"] < keys.size and time.monotonic() < deadline:
            time.sleep(0.5)
            cleared = httpx.post(f"{http}/v1/cache/ranker/sparse_embedding0/clear", timeout=5,
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert cleared.status_code == 200, cleared.text
            client.lookup("ranker", "sparse_embedding0", keys)
        assert volatile()["rows"] >= keys.size, (volatile(), srv.log()[-3000:])
        assert sum(redis_cluster_clean.client(i).dbsize() for i in range(3)) > 0
        assert srv.stop() == 0


def test_a_ps_json_with_a_kafka_update_source_serves_and_follows_its_update_topic(kafka_broker,
                                                                                  tmp_path: Path) -> None:
    def use_the_fixture(ps: dict) -> None:
        ps["update_source"]["brokers"] = kafka_broker.bootstrap

    config, _, tables = _migrate("kafka_update_source.json", tmp_path, use_the_fixture)
    keys, rows, dim, _ = tables[("news_ctr", "item")]
    srv, _ = _server(config)
    with srv, HPSClient(srv.target) as client:
        _check_rows(client, tables)
        fresh = np.full((10, dim), 7.0, np.float32)
        with Publisher(kafka_broker.bootstrap, "news_ctr", topic_prefix="hps") as publisher:
            publisher.publish("item", keys[:10], fresh, make_version(1, 1))
            publisher.flush(10)
        deadline = time.monotonic() + 60
        while not np.array_equal(client.lookup("news_ctr", "item", keys[:10]), fresh):
            assert time.monotonic() < deadline, "the published rows were not served within 60 s"
            time.sleep(0.05)
        np.testing.assert_array_equal(client.lookup("news_ctr", "item", keys[10:]), rows[10:])
        assert srv.stop() == 0
