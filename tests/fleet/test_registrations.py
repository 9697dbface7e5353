"""Models registered at runtime in a fleet (issue 27, defect 7): ``POST /v1/models`` returns once every gRPC worker
of the node serves the model, and the registration travels through the registration log to every other replica
(an unload too), signed with updates.admin_key (issue F1). Two in-process replicas, the first with two gRPC worker
processes, and tansu."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from hps_service.updates import Publisher
from tests.fleet.replica import DIM, Replica
from tests.updates.conftest import wait_until


@pytest.fixture
def fleet(kafka_broker, tmp_path: Path):
    prefix = f"r{uuid.uuid4().hex[:6]}"
    replicas = []
    try:
        replicas.append(Replica(tmp_path, "a", kafka_broker.bootstrap, prefix, workers=2))
        replicas.append(Replica(tmp_path, "b", kafka_broker.bootstrap, prefix, workers=0))
        yield prefix, replicas
    finally:
        for replica in replicas:
            replica.close()


def test_a_model_registered_on_one_replica_is_served_at_once_by_its_workers_and_soon_by_the_other(
        kafka_broker, fleet) -> None:
    """Each registration is looked up the moment the POST returned, on every worker of the replica that took it
    (no retry). Before: a worker could answer NOT_FOUND for a while (it had not yet loaded the owner's manifest,
    or was loading it), and the other replica never learnt of the model."""
    prefix, (a, b) = fleet
    keys = np.arange(1, 65, dtype=np.int64)
    names = [f"late{i}" for i in range(3)]
    for name in names:
        r = a.http.post("/v1/models", json={"name": name, "tables": [{"name": "item", "dim": DIM}]})
        assert r.status_code == 201 and r.json()["replicated"] is True, r.text
        for client in a.clients:
            assert np.array_equal(client.lookup(name, "item", keys), np.zeros((keys.size, DIM), np.float32))
    assert wait_until(lambda: all(b.loaded(n) for n in names), timeout=30), b.http.get("/v1/models").json()
    for client in b.clients:
        assert client.lookup(names[0], "item", keys).shape == (keys.size, DIM)
    registry = b.http.get("/v1/stats").json()["registry"]
    assert registry["failed"] == {} and registry["refused"] == {"no_key": 0, "unsigned": 0, "bad_signature": 0}

    rows = np.full((keys.size, DIM), 0.5, np.float32)
    with Publisher(kafka_broker.bootstrap, names[0], topic_prefix=prefix, partitions=2) as pub:
        pub.publish("item", keys, rows, 1)
    for replica in (a, b):  # both consume the topic of the model registered on one
        assert wait_until(lambda r=replica: np.array_equal(r.clients[0].lookup(names[0], "item", keys), rows),
                          timeout=30)

    r = b.http.delete(f"/v1/models/{names[1]}")
    assert r.status_code == 200 and r.json() == {"unloaded": names[1], "replicated": True}, r.text
    assert not b.loaded(names[1])
    assert wait_until(lambda: not a.loaded(names[1]), timeout=30)
    assert a.http.post("/v1/models", json={"name": names[0], "tables": [{"name": "item", "dim": DIM}]}
                       ).status_code == 409


def test_versions_and_label_switches_reach_every_replica_through_the_log(kafka_broker, fleet) -> None:
    """A version added on one replica, its rows published once, and a label switch and a rollback made on the other:
    every worker of both replicas serves them (the switch is one message on the one-partition registration log, so
    every replica makes it at the same offset)."""
    prefix, (a, b) = fleet
    keys = np.arange(1, 65, dtype=np.int64)
    r = a.http.post("/v1/models/base/versions", json={"version": 1})
    assert r.status_code == 201 and r.json()["replicated"] is True, r.text
    assert wait_until(lambda: b.http.get("/v1/models/base").json()["versions"] == [1], timeout=30)
    old, new = np.full((keys.size, DIM), 0.25, np.float32), np.full((keys.size, DIM), 0.75, np.float32)
    with Publisher(kafka_broker.bootstrap, "base", topic_prefix=prefix, partitions=2) as pub:
        pub.publish("item", keys, old, 1)
    with Publisher(kafka_broker.bootstrap, "base", topic_prefix=prefix, partitions=2, model_version=1) as pub:
        pub.publish("item", keys, new, 1)

    def serve(replica: Replica, rows: np.ndarray) -> bool:
        return all(np.array_equal(c.lookup("base", "item", keys), rows) for c in replica.clients)

    assert wait_until(lambda: serve(a, old) and serve(b, old), timeout=30)
    switched = b.http.put("/v1/models/base/labels/production", json={"version": 1})
    assert switched.status_code == 200 and switched.json()["replicated"] is True, switched.text
    assert serve(b, new)  # the replica asked serves it once the PUT returned
    assert wait_until(lambda: serve(a, new), timeout=30)
    assert a.http.get("/v1/models/base").json()["labels"] == {"production": 1}
    rolled = a.http.put("/v1/models/base/labels/production", json={"version": 0})  # a rollback
    assert rolled.status_code == 200 and serve(a, old)
    assert wait_until(lambda: serve(b, old), timeout=30)
    offsets = [replica.http.get("/v1/stats").json()["registry"]["label_offsets"] for replica in (a, b)]
    assert offsets[0] == offsets[1] and offsets[0], offsets  # both made each switch at the same offset of the log
    dropped = b.http.delete("/v1/models/base/versions/1")
    assert dropped.status_code == 200 and dropped.json()["replicated"] is True, dropped.text
    assert wait_until(lambda: a.http.get("/v1/models/base").json()["versions"] == [], timeout=30)


def test_both_shards_of_a_sharded_fleet_switch_a_label_at_the_same_offset(kafka_broker, tmp_path: Path) -> None:
    """Two shards (one replica each) share the registration log: a version added on one, its rows published once
    (each shard applies its keys), and a label switched on the other reach both, each having applied the log up
    to the same offset."""
    from hps_client.partitioning import shard_of

    prefix = f"s{uuid.uuid4().hex[:6]}"
    shards = [Replica(tmp_path, f"shard{i}", kafka_broker.bootstrap, prefix, workers=0, shards=2, shard=i)
              for i in range(2)]
    try:
        keys = np.arange(1, 257, dtype=np.int64)
        owned = [keys[shard_of(keys, 2, 2) == i] for i in range(2)]
        r = shards[0].http.post("/v1/models/base/versions", json={"version": 1})
        assert r.status_code == 201 and r.json()["replicated"] is True, r.text
        assert wait_until(lambda: shards[1].http.get("/v1/models/base").json()["versions"] == [1], timeout=30)
        new = np.full((keys.size, DIM), 0.5, np.float32)
        with Publisher(kafka_broker.bootstrap, "base", topic_prefix=prefix, partitions=2, model_version=1) as pub:
            pub.publish("item", keys, new, 1)

        def serve(i: int, version: int) -> bool:
            got = shards[i].clients[0].lookup("base", "item", owned[i], version=version)
            return bool(np.array_equal(got, new[: owned[i].size])) if version else not got.any()

        assert wait_until(lambda: serve(0, 1) and serve(1, 1), timeout=30)
        assert serve(0, 0) and serve(1, 0)  # the model as configured has none of version 1's rows
        switched = shards[1].http.put("/v1/models/base/labels/production", json={"version": 1})
        assert switched.status_code == 200 and switched.json()["replicated"] is True, switched.text
        for i in range(2):
            assert wait_until(lambda i=i: np.array_equal(shards[i].clients[0].lookup("base", "item", owned[i]),
                                                         new[: owned[i].size]), timeout=30)
        offsets = [s.http.get("/v1/stats").json()["registry"]["label_offsets"] for s in shards]
        assert offsets[0] == offsets[1] and offsets[0], offsets  # the switch made at the same offset on both
    finally:
        for s in shards:
            s.close()


def test_a_switch_waits_for_every_replica_and_names_the_one_behind(kafka_broker, fleet, monkeypatch) -> None:
    """A label switch goes on the log only once every replica reports the version switchable (its statuses on the
    registration log): with the other replica not ready, the PUT answers 409 naming it and what it lacks; once it
    is ready again, the same PUT switches both."""
    from hps_service.fleet import switch_gate

    prefix, (a, b) = fleet
    assert a.http.post("/v1/models/base/versions", json={"version": 3}).status_code == 201
    assert wait_until(lambda: "b" in a.http.get("/v1/stats").json()["registry"]["members"], timeout=30)

    def held_back() -> str:
        return "held back by the test"

    monkeypatch.setattr(switch_gate, "WAIT_S", 3.0)
    b.srv.readiness.append(held_back)
    time.sleep(2 * switch_gate.PUBLISH_S + 0.5)  # b's next status on the log, and a reading it
    try:
        refused = a.http.put("/v1/models/base/labels/production", json={"version": 3, "allow_empty": True})
        assert refused.status_code == 409, refused.text
        assert "replica b: held back by the test" in refused.json()["detail"], refused.text
        assert a.http.get("/v1/models/base").json()["labels"] == {}
    finally:
        b.srv.readiness.remove(held_back)
    switched = a.http.put("/v1/models/base/labels/production", json={"version": 3, "allow_empty": True})
    assert switched.status_code == 200, switched.text
    assert wait_until(lambda: b.http.get("/v1/models/base").json()["labels"] == {"production": 3}, timeout=30)


def test_a_switch_is_refused_while_a_table_of_the_version_is_empty_on_another_replica(fleet, monkeypatch) -> None:
    """Issue 53: the version holds rows on the replica asked but none on the other; the PUT answers 409 naming that
    replica and the empty table (its status carries the empty tables apart), and switches with allow_empty."""
    from hps_service.fleet import switch_gate

    prefix, (a, b) = fleet
    assert a.http.post("/v1/models/base/versions", json={"version": 5}).status_code == 201
    assert wait_until(lambda: b.loaded("base") and b.http.get("/v1/models/base").json()["versions"] == [5], timeout=30)
    keys = np.arange(1, 33, dtype=np.int64)
    assert a.srv.engine is not None  # rows on replica a only (not through the update log)
    assert a.srv.engine.put_rows("base#v5", "item", keys, np.ones((keys.size, DIM), np.float32), 1).written == 32
    monkeypatch.setattr(switch_gate, "WAIT_S", 3.0)
    time.sleep(2 * switch_gate.PUBLISH_S + 0.5)  # b's next status on the log, and a reading it
    refused = a.http.put("/v1/models/base/labels/production", json={"version": 5})
    assert refused.status_code == 409, refused.text
    assert "replica b: table item of version 5 of model 'base' holds no rows" in refused.json()["detail"]
    switched = a.http.put("/v1/models/base/labels/production", json={"version": 5, "allow_empty": True})
    assert switched.status_code == 200, switched.text
    assert wait_until(lambda: b.http.get("/v1/models/base").json()["labels"] == {"production": 5}, timeout=30)


def test_a_strict_put_through_the_update_log_is_refused_when_this_replica_holds_newer_rows(fleet) -> None:
    """Issue 53, part 5, with Kafka updates on: the put is checked against this replica's rows before it is
    published; a stale one is refused with 409 and nothing is published."""
    _, (a, _b) = fleet
    rows = "/v1/models/base/tables/item/embeddings"
    body = {"keys": [7, 8], "vectors": [[1.0] * DIM, [1.0] * DIM], "row_version": 5}
    first = a.http.put(rows, params={"wait": "applied", "strict": "true"}, json=body)
    assert first.status_code == 200 and first.json()["published"] == 2, first.text
    stale = a.http.put(rows, params={"wait": "applied", "strict": "true"},
                       json={**body, "vectors": [[2.0] * DIM] * 2, "row_version": 4})
    assert stale.status_code == 409 and "2 of 2 rows are older than the rows this replica stores" in stale.text
    assert np.array_equal(a.clients[0].lookup("base", "item", [7, 8]), np.ones((2, DIM), np.float32))
