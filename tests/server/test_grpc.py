"""gRPC over real ports: StreamLookup, ListModels/GetModel, deadlines, the concurrency limit, draining."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_service.client import HPSClient, build_request, decode_answer
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.server.conftest import (
    AUTH,
    ITEM_DIM,
    USER_DIM,
    HeldLookups,
    OpenStream,
    base_url,
    running,
    server_config,
    target,
)


def _seed(server: HPSServer, keys: np.ndarray) -> np.ndarray:
    rows = np.random.default_rng(int(keys[0])).standard_normal((keys.shape[0], ITEM_DIM)).astype(np.float32)
    with httpx.Client(base_url=base_url(server)) as http:
        r = http.put("/v1/models/demo/tables/item/embeddings", json={"keys": keys.tolist(), "vectors": rows.tolist()},
                     headers=AUTH)
        assert r.status_code == 200
    return rows


def test_stream_lookup_answers_in_order_with_request_ids(server: HPSServer) -> None:
    keys = np.arange(100, 140, dtype=np.int64)
    rows = _seed(server, keys)
    requests = []
    for i in range(8):
        req = build_request("demo", {"item": keys[i * 5:(i + 1) * 5], "user": [i]})
        req.request_id = 1000 + i
        requests.append(req)
    with grpc.insecure_channel(target(server)) as channel:
        answers = list(pb_grpc.EmbeddingServiceStub(channel).StreamLookup(iter(requests), timeout=30))
    assert [a.request_id for a in answers] == [1000 + i for i in range(8)]
    for i, a in enumerate(answers):
        by_table = {tv.table: decode_answer(tv) for tv in a.tables}
        np.testing.assert_array_equal(by_table["item"].vectors, rows[i * 5:(i + 1) * 5])
        np.testing.assert_array_equal(by_table["user"].vectors, np.full((1, USER_DIM), 0.5, np.float32))


def test_stream_lookup_error_names_the_problem(server: HPSServer) -> None:
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        reqs = [build_request("demo", {"item": [1]}), build_request("demo", {"nope": [1]})]
        responses = stub.StreamLookup(iter(reqs), timeout=30)
        assert next(responses).model == "demo"
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no table 'nope'" in err.value.details()


def test_list_models_and_get_model(server: HPSServer) -> None:
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        listed = stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert "demo" in [m.name for m in listed.models]
        info = stub.GetModel(pb.GetModelRequest(model="demo"), timeout=10)
        assert {(t.name, t.dim) for t in info.tables} == {("item", ITEM_DIM), ("user", USER_DIM)}
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModel(pb.GetModelRequest(model="absent"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "absent" in err.value.details()


def test_deadline_passed_while_queued_is_not_served(tmp_path: Path) -> None:
    """The one handler thread busy with a held lookup: a Lookup queued behind it past its deadline gets
    DEADLINE_EXCEEDED and never reaches the engine; the server then serves normally."""
    with running(server_config(tmp_path, workers=0, grpc_workers=1)) as srv, HeldLookups(srv) as held, \
            grpc.insecure_channel(target(srv)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        holder = stub.Lookup.future(build_request("demo", {"item": [1]}), timeout=30)
        held.wait_entered()
        before = srv.engine.table_stats("demo", "user")["cache"]
        queued = stub.Lookup.future(build_request("demo", {"user": [1, 2, 3]}), timeout=0.2)
        with pytest.raises(grpc.RpcError) as err:
            queued.result()
        held.release()
        assert holder.result().tables[0].count == 1
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        after = srv.engine.table_stats("demo", "user")["cache"]
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
        answer = stub.Lookup(build_request("demo", {"user": [1, 2, 3]}), timeout=10)
        assert answer.tables[0].count == 3


def test_over_max_concurrent_requests_is_resource_exhausted(tmp_path: Path) -> None:
    """gRPC's limit of calls in flight is max_concurrent_requests plus max_streams: an open stream leaves the
    unary calls their own, and the unary call past it is refused."""
    config = server_config(tmp_path, workers=0, max_concurrent_requests=1, max_streams=1)
    with running(config) as srv, HeldLookups(srv) as held, grpc.insecure_channel(target(srv)) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        stream = OpenStream(stub)
        stream.ask(build_request("demo", {"user": [1]}))
        holder = stub.Lookup.future(build_request("demo", {"item": [1]}), timeout=30)
        held.wait_entered()
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(build_request("demo", {"user": [1]}), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.release()
        assert holder.result().tables[0].count == 1
        stream.close()
        deadline = time.monotonic() + 10
        while True:  # the slot is released once the held call's handler has returned
            try:
                assert stub.Lookup(build_request("demo", {"item": [1]}), timeout=10).tables[0].count == 1
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)


def test_draining_server_answers_unavailable_on_open_streams(tmp_path: Path) -> None:
    srv = HPSServer(server_config(tmp_path))
    srv.start()
    stopper = threading.Thread(target=srv.stop, kwargs={"grace": 9})
    try:
        with grpc.insecure_channel(target(srv)) as channel:
            stream = OpenStream(pb_grpc.EmbeddingServiceStub(channel))
            assert stream.ask(build_request("demo", {"item": [1]})).tables[0].count == 1
            stopper.start()
            while not srv.gate.draining:
                time.sleep(0.01)
            # The lame duck (up to a third of the grace, the stream keeps the server busy): NOT_SERVING, still answering.
            ready = httpx.get(base_url(srv) + "/readyz", timeout=10)
            assert ready.status_code == 503 and "draining" in ready.json()["error"]
            assert stream.ask(build_request("demo", {"item": [1]})).tables[0].count == 1
            while srv.gate.is_open:
                time.sleep(0.01)
            # The gate's refusal, or the GOAWAY of the server that stops right after closing it (its REST listener
            # closes soon after too, so readiness is checked in the lame duck above, not here).
            with pytest.raises(grpc.RpcError) as err:
                stream.ask(build_request("demo", {"item": [1]}))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    finally:
        if stopper.ident is not None:
            stopper.join()
        else:
            srv.stop(grace=0)


def test_hps_client_lookup_many(server: HPSServer) -> None:
    keys = np.arange(300, 310, dtype=np.int64)
    rows = _seed(server, keys)
    with HPSClient(target(server)) as client:
        got = client.lookup_many("demo", {"item": keys, "user": [7, 8]})
    np.testing.assert_array_equal(got["item"].vectors, rows)
    assert got["user"].vectors.shape == (2, USER_DIM)
