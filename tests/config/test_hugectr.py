"""``hps config from-hugectr`` on HugeCTR HPS ps.json files shaped as HPS's documentation, notebooks and CI write them
(tests/fixtures/hugectr): every key is accounted for in the YAML's comments (mapped, or not applicable with a reason),
the values land where they mean the same, and the YAML is a config hps serve accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hps_service.config import load_config
from hps_service.config.hugectr import HugeCTRConfigError, convert
from tests.helpers import REPO, run_hps

FIXTURES = REPO / "tests" / "fixtures" / "hugectr"
NESTED = ("volatile_db", "persistent_db", "update_source")


def _key_paths(ps: dict) -> list[str]:
    """Every key of a ps.json as the notes name it: top-level, section.key, models[i].key."""
    paths = [k for k in ps if k not in (*NESTED, "models")]
    paths += [f"{section}.{k}" for section in NESTED for k in ps.get(section, {})]
    paths += [f"models[{i}].{k}" for i, m in enumerate(ps["models"]) for k in m]
    return paths


def _convert_cli(fixture: Path, tmp_path: Path, *args: str) -> tuple[str, str]:
    out = tmp_path / "hps.yaml"
    done = run_hps("config", "from-hugectr", str(fixture), "--out", str(out), *args)
    assert done.returncode == 0, done.stderr
    return out.read_text(), done.stderr


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_every_hps_key_is_mapped_or_said_not_applicable_and_the_yaml_is_a_valid_config(fixture: Path,
                                                                                       tmp_path: Path) -> None:
    text, _ = _convert_cli(fixture, tmp_path)
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    ps = json.loads(fixture.read_text())
    missing = [p for p in _key_paths(ps) if f"{p}:" not in comments and f"{p} x " not in comments
               and f"/ {p}:" not in comments]
    assert not missing, f"keys of {fixture.name} the YAML does not account for: {missing}\n{comments}"
    assert "not applicable" in comments and "->" in comments
    cfg = load_config(tmp_path / "hps.yaml")
    assert [m.name for m in cfg.models] == [m["model"] for m in ps["models"]]


def test_single_model_values_carry_their_meaning() -> None:
    conv = convert(json.loads((FIXTURES / "wdl_single_model.json").read_text()), FIXTURES)
    c = conv.config
    assert c["models"] == [{"name": "wdl", "tables": [{"name": "wide", "dim": 1, "default": "zeros"},
                                                      {"name": "deep", "dim": 16, "default": "zeros"}]}]
    assert c["cache"] == {"capacity": 0.5, "hit_rate_threshold": 0.9, "refresh_fraction": 0.2}  # strings read
    assert c["volatile"] == {"type": "hashmap", "capacity_rows": 4 * 500000, "overflow_policy": "lru",
                             "overflow_evict_fraction": 0.2}
    assert c["persistent"] == {"type": "rocksdb", "path": "./var/rocksdb"}  # not HugeCTR's RocksDB: its format
    assert c["updates"] == {"type": "disabled"}
    assert "server" not in c  # 64 samples x 26 keys fit the default bound
    assert [(i.model, i.table, i.path) for i in conv.imports] == [
        ("wdl", "wide", FIXTURES / "wdl/1/wdl0_sparse_20000.model"),
        ("wdl", "deep", FIXTURES / "wdl/1/wdl1_sparse_20000.model")]


def test_multi_model_redis_cluster_values() -> None:
    conv = convert(json.loads((FIXTURES / "multi_model_redis_cluster.json").read_text()), FIXTURES)
    c = conv.config
    assert c["volatile"] == {"type": "redis_cluster", "nodes": ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"],
                             "partitions": 8}
    assert c["models"][1]["tables"] == [{"name": "sparse_embedding0", "dim": 64, "default": "zeros"},
                                        {"name": "sparse_embedding1", "dim": 8, "default": {"constant": 1.0}}]
    assert c["models"][0]["tables"][0]["default"] == {"constant": 0.5}
    assert c["cache"]["capacity"] == 0.2  # models[0]'s: one cache section here
    assert c["server"] == {"max_batch_keys": 16384 * 10}
    notes = "\n".join(conv.notes["volatile"] + conv.notes["cache"])
    assert "maxmemory-policy allkeys-lfu" in notes
    assert "models[1].gpucacheper: 0.1 -> not applicable" in notes


def test_kafka_update_source_values_and_the_format_note(tmp_path: Path) -> None:
    text, stderr = _convert_cli(FIXTURES / "kafka_update_source.json", tmp_path)
    updates = yaml.safe_load(text)["updates"]
    assert updates == {"type": "kafka", "brokers": "kafka-0.kafka:9092,kafka-1.kafka:9092", "topic_prefix": "hps",
                       "kafka_config": {"topic.metadata.refresh.interval.ms": 30000}}
    assert "hps_service.updates.Publisher" in stderr and "hps.<model>" in stderr
    assert yaml.safe_load(text)["cache"] == {"capacity": 0.5, "hit_rate_threshold": 0.9, "refresh_interval_s": 60.0,
                                             "refresh_fraction": 0.1}


def test_a_redis_password_stays_out_of_the_yaml(tmp_path: Path) -> None:
    ps = json.loads((FIXTURES / "multi_model_redis_cluster.json").read_text())
    ps["volatile_db"]["password"] = "hunter2-redis"
    (tmp_path / "ps.json").write_text(json.dumps(ps))
    text, stderr = _convert_cli(tmp_path / "ps.json", tmp_path)
    assert "hunter2-redis" not in text and "password" not in yaml.safe_load(text)["volatile"]
    assert "HPS_VOLATILE__PASSWORD" in stderr


@pytest.mark.parametrize(("change", "named"), [
    (lambda ps: ps["models"][0].pop("embedding_vecsize_per_table"), "models[0].embedding_vecsize_per_table"),
    (lambda ps: ps["models"][0].update(gpucache="maybe"), "models[0].gpucache"),
    (lambda ps: ps["volatile_db"].update(type="memcached"), "volatile_db.type"),
])
def test_a_ps_json_that_cannot_be_converted_names_its_key(change, named: str, tmp_path: Path) -> None:
    ps = json.loads((FIXTURES / "wdl_single_model.json").read_text())
    change(ps)
    with pytest.raises(HugeCTRConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        convert(ps, tmp_path)
    (tmp_path / "ps.json").write_text(json.dumps(ps))
    done = run_hps("config", "from-hugectr", str(tmp_path / "ps.json"))
    assert done.returncode == 2 and named in done.stderr, done.stderr
