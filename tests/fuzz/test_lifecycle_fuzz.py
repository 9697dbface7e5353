"""Hypothesis fuzz of a model's lifecycle on a real `hps serve` with two workers: random sequences of version adds and
drops, label switches and removals (with names and numbers that exist and that do not), each followed by gRPC
lookups naming every label and version there is. Every admin call is answered or refused (never 5xx), every lookup
answers at the version it named, or the label's, or is a clear status (never INTERNAL or UNKNOWN), every label's
lookups come to answer at its version, and no worker dies. An add takes a fresh number or one the model had and
lost (a version dropped and added again; what rows it answers is the history check's, tests/history).
``HPS_RUN_LONG=1`` runs ten times as many sequences."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.helpers import ServerProcess, free_port, write_config

ADMIN = "lifecycle-admin-token-0001"
LONG = os.environ.get("HPS_RUN_LONG", "") not in ("", "0")
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
ADMIN_ANSWERS = {200, 201, 400, 404, 409, 422}
LABELS = ["production", "canary", "shadow"]


class Node:
    """The server, its admin API, gRPC channels (two connections, so both workers are likely asked) and fresh
    version numbers."""

    def __init__(self, server: ServerProcess, http_port: int) -> None:
        self.server = server
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60,
                                 headers={"Authorization": f"Bearer {ADMIN}"})
        self.stubs = [pb_grpc.EmbeddingServiceStub(grpc.insecure_channel(
            server.target, options=[("grpc.use_local_subchannel_pool", 1)])) for _ in range(2)]
        self.fresh = itertools.count(2)
        self.dropped: list[int] = []  # numbers the model had and lost
        self.workers = self.worker_pids()

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.http.get("/v1/stats").json()["node"]["workers"]]

    def state(self) -> tuple[list[int], dict[str, int]]:
        """The versions of demo and its labels, as the admin API lists them."""
        body = self.http.get("/v1/models/demo/versions").json()
        return [v["version"] if isinstance(v, dict) else v for v in body["versions"]], body["labels"]

    def lookup(self, i: int, **named: object) -> pb.LookupResponse | grpc.StatusCode:
        request = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=np.arange(4, dtype="<i8")
                                                                      .tobytes())], **named)
        try:
            return self.stubs[i % 2].Lookup(request, timeout=30)
        except grpc.RpcError as err:
            assert err.code() in CLEAR and err.details(), f"{err.code().name}: {err.details()}"
            return err.code()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp: Path = tmp_path_factory.mktemp("lifecycle")
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 2, "grpc_workers": 2,
                   "admin_token": ADMIN},
        "cache": {"backend": "numpy", "capacity": 256},
        "volatile": {"type": "hashmap", "capacity_rows": 10_000},
        "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "keep_versions": 3, "tables": [{"name": "item", "dim": 4}]}],
    })
    with ServerProcess(cfg, grpc_port) as server:
        n = Node(server, http_port)
        yield n
        assert server.proc is not None and server.proc.poll() is None
        assert n.worker_pids() == n.workers and n.http.get("/v1/stats").json()["node"]["restarts"] == 0
        n.http.close()


def _version(node: Node, draw: int) -> int:
    """A version number: one the model has (most often), or any other."""
    versions, _ = node.state()
    return versions[draw % len(versions)] if versions and draw >= 0 else abs(draw) % 9


operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.booleans()),
    st.tuples(st.just("drop"), st.integers(-3, 20)),
    st.tuples(st.just("label"), st.one_of(st.sampled_from(LABELS), st.text(min_size=1, max_size=70)),
              st.integers(-3, 20)),
    st.tuples(st.just("unlabel"), st.one_of(st.sampled_from(LABELS), st.text(min_size=1, max_size=70)))),
    min_size=1, max_size=6)


@settings(max_examples=100 if LONG else 10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_a_models_lifecycle_answers_or_refuses_cleanly(node: Node, ops: list[tuple]) -> None:
    for op in ops:
        before, _ = node.state()
        if op[0] == "add":
            again = op[1] and node.dropped
            r = node.http.post("/v1/models/demo/versions",
                               json={"version": node.dropped.pop() if again else next(node.fresh)})
        elif op[0] == "drop":
            r = node.http.delete(f"/v1/models/demo/versions/{_version(node, op[1])}")
        elif op[0] == "label":
            r = node.http.put(f"/v1/models/demo/labels/{quote(op[1], safe='')}",
                              json={"version": _version(node, op[2])})
        else:
            r = node.http.delete(f"/v1/models/demo/labels/{quote(op[1], safe='')}")
        assert r.status_code in ADMIN_ANSWERS, (op, r.status_code, r.text)
        versions, labels = node.state()
        node.dropped += [v for v in before if v not in versions]  # dropped, or retired by keep_versions
        for i, version in enumerate(versions):  # a version answers as itself, or is not there yet / any more
            answer = node.lookup(i, version=version)
            assert not isinstance(answer, pb.LookupResponse) or answer.version == version
        for i, (label, version) in enumerate(labels.items()):
            answer = node.lookup(i, label=label)
            assert not isinstance(answer, pb.LookupResponse) or answer.version in (version, *versions), label
    _, labels = node.state()
    deadline = time.monotonic() + 15
    for label, version in labels.items():  # every worker comes to answer each label at its version
        for i in range(2):
            while True:
                answer = node.lookup(i, label=label)
                if isinstance(answer, pb.LookupResponse) and answer.version == version:
                    break
                assert time.monotonic() < deadline, (label, version, answer)
                time.sleep(0.05)
