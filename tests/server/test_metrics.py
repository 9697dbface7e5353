"""/metrics parsed with prometheus_client's parser; counters checked against the lookups this test makes."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from hps_service.client import HPSClient, build_request
from hps_service.errors import NotFoundError
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.server.conftest import AUTH, USER_DIM, base_url, running, server_config, target


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as ``{(name, sorted labels): value}``."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_match_the_lookups_made(tmp_path: Path) -> None:
    stored = np.arange(1, 41, dtype=np.int64)  # 40 stored keys
    absent = np.arange(10_001, 10_011, dtype=np.int64)  # 10 keys stored nowhere
    with running(server_config(tmp_path)) as srv, httpx.Client(base_url=base_url(srv)) as http:
        rows = np.ones((stored.shape[0], USER_DIM), np.float32)
        r = http.put("/v1/models/demo/tables/user/embeddings",
                     json={"keys": stored.tolist(), "vectors": rows.tolist()}, headers=AUTH)
        assert r.status_code == 200
        before = scrape(http)
        query = np.concatenate([stored, absent])
        n_lookups, n_stream = 6, 4
        with HPSClient(target(srv)) as client:
            for _ in range(n_lookups):
                client.lookup("demo", "user", query)
            try:
                client.lookup("demo", "missing_table", [1])
            except NotFoundError:
                pass
            else:
                raise AssertionError("a lookup of an unknown table succeeded")
        with grpc.insecure_channel(target(srv)) as channel:
            stream = pb_grpc.EmbeddingServiceStub(channel).StreamLookup(
                iter([build_request("demo", {"user": query})] * n_stream), timeout=30)
            assert len(list(stream)) == n_stream
        after = scrape(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    total = n_lookups + n_stream
    assert delta("hps_lookup_requests_total", method="Lookup", status="OK") == n_lookups
    assert delta("hps_lookup_requests_total", method="Lookup", status="NOT_FOUND") == 1
    assert delta("hps_lookup_requests_total", method="StreamLookup", status="OK") == n_stream
    assert delta("hps_lookup_latency_seconds_count", method="Lookup") == n_lookups + 1
    assert delta("hps_lookup_latency_seconds_count", method="StreamLookup") == n_stream
    assert delta("hps_lookup_keys_count") == total + 1
    assert delta("hps_lookup_keys_sum") == total * query.shape[0] + 1

    t = {"model": "demo", "table": "user"}
    cache_hits = delta("hps_tier_hits_total", tier="cache", **t)
    cache_misses = delta("hps_tier_misses_total", tier="cache", **t)
    assert cache_hits + cache_misses == total * query.shape[0]  # every key asks L1 first
    assert cache_hits >= (total - 1) * stored.shape[0]  # stored rows stay cached after the first lookup
    volatile = delta("hps_tier_hits_total", tier="volatile", **t) + delta("hps_tier_misses_total", tier="volatile", **t)
    assert volatile == cache_misses  # each request's misses are unique here
    persistent_misses = delta("hps_tier_misses_total", tier="persistent", **t)
    assert delta("hps_default_vectors_total", **t) == persistent_misses == total * absent.shape[0]
    assert value(after, "hps_tier_rows", tier="persistent", **t) == stored.shape[0]
    assert value(after, "hps_cache_rows", **t) >= stored.shape[0]
    assert value(after, "hps_cache_capacity_rows", **t) > 0
    assert ("hps_cache_evictions_total", tuple(sorted(t.items()))) in after
    assert value(after, "hps_cache_admission_refused_total", **t) == 0  # the cache never filled
    assert ("hps_cache_promotion_queue_depth", tuple(sorted(t.items()))) in after
    assert any(name.startswith("process_") or name == "python_info" for name, _ in after)
