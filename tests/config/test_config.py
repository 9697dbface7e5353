"""Config: YAML + HPS_* environment overrides, one message naming each bad key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hps_service.config import ConfigError, ConstantDefault, load_config


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_match_architecture() -> None:
    cfg = load_config()
    assert cfg.server.grpc_port == 8500 and cfg.server.http_port == 8000 and cfg.server.max_batch_keys == 65536
    assert cfg.cache.capacity == 0.2 and cfg.cache.ways == 32 and cfg.cache.policy == "lru"
    assert cfg.volatile.type == "hashmap" and cfg.persistent.type == "rocksdb" and cfg.updates.type == "disabled"


def test_file_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, {
        "server": {"grpc_port": 9100, "http_port": 9101},
        "cache": {"capacity": 5000},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 16, "default": {"constant": 0.1}}]}],
    })
    monkeypatch.setenv("HPS_SERVER__GRPC_PORT", "9000")
    monkeypatch.setenv("HPS_VOLATILE__TYPE", "disabled")
    cfg = load_config(p)
    assert cfg.server.grpc_port == 9000  # env wins
    assert cfg.server.http_port == 9101  # file kept where env is silent
    assert cfg.volatile.type == "disabled"
    assert cfg.cache.capacity == 5000 and isinstance(cfg.cache.capacity, int)
    assert cfg.model("demo").table("item").default == ConstantDefault(constant=0.1)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"cache": {"ways": "many"}}, "cache.ways"),
        ({"cache": {"capacity": 1.5}}, "cache.capacity"),
        ({"server": {"grpc_port": 70000}}, "server.grpc_port"),
        ({"volatile": {"type": "redis_cluster"}}, "volatile.nodes"),
        ({"volatile": {"type": "memcached"}}, "volatile.type"),
        ({"bogus": 1}, "bogus"),
        ({"models": [{"name": "bad name", "tables": [{"name": "t", "dim": 4}]}]}, "models.0.name"),
        ({"models": [{"name": "m", "tables": [{"name": "t", "dim": 4}, {"name": "t", "dim": 8}]}]}, "duplicate"),
        ({"models": [{"name": "m", "tables": [{"name": "t", "dim": 0}]}]}, "models.0.tables.0.dim"),
        ({"models": [{"name": "m", "tables": [{"name": "t", "dim": 4, "admit_after_writes": 0}]}]},
         "models.0.tables.0.admit_after_writes"),
        ({"models": [{"name": "m", "tables": [{"name": "t", "dim": 4, "admit_after_writes": 65536}]}]},
         "models.0.tables.0.admit_after_writes"),
    ],
)
def test_invalid_config_names_the_key(tmp_path: Path, data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data))
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)
    p.write_text("server: {grpc_port: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_env_override_is_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPS_SERVER__MAX_BATCH_KEYS", "-3")
    with pytest.raises(ConfigError, match="server.max_batch_keys"):
        load_config(write(tmp_path, {}))


def test_cluster_shards_partitions_and_shard_are_checked_in_one_line() -> None:
    cfg = load_config(None)
    assert (cfg.cluster.shards, cfg.cluster.shard, cfg.cluster.partitions) == (1, 0, 24)
    assert load_config(None, cluster={"shards": 4, "shard": 3, "partitions": 8}).cluster.shard == 3
    with pytest.raises(ConfigError) as err:
        load_config(None, cluster={"shards": 4, "partitions": 10})
    assert "cluster.partitions (10) must be a multiple of cluster.shards (4)" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"cluster.shard \(2\) must be below cluster.shards \(2\)"):
        load_config(None, cluster={"shards": 2, "shard": 2})


def test_kafka_updates_without_a_persistent_tier_are_refused_in_one_line(tmp_path: Path) -> None:
    """Offsets would be committed for updates held only in memory (issue 14, defect 5)."""
    data = {"persistent": {"type": "disabled"}, "updates": {"type": "kafka", "brokers": "127.0.0.1:9092"}}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, data))
    assert "updates.type kafka needs persistent.type rocksdb" in str(err.value) and "\n" not in str(err.value)
    assert load_config(write(tmp_path, {**data, "updates": {"type": "disabled"}})).persistent.type == "disabled"
    assert load_config(write(tmp_path, {"updates": data["updates"]})).updates.type == "kafka"


def test_worker_processes_default_to_the_usable_cpus_and_local_reads_need_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from hps_service.runtime.cpus import usable_cpus

    cfg = load_config(None)
    assert cfg.server.workers is None and cfg.server.worker_processes() == usable_cpus()
    assert cfg.server.grpc_threads() == 2 and cfg.server.local_socket() is None
    monkeypatch.setenv("HPS_SERVER__WORKERS", "0")
    single = load_config(None)
    assert single.server.worker_processes() == 0 and single.server.grpc_threads() >= 2
    with pytest.raises(ConfigError, match="server.local needs the shared store of a node"):
        load_config(None, server={"local": {"enabled": True}})
    monkeypatch.delenv("HPS_SERVER__WORKERS")
    local = load_config(None, server={"local": {"enabled": True, "path": "/dev/shm/x"}})
    assert str(local.server.local_socket()) == "/dev/shm/x/grpc.sock"
