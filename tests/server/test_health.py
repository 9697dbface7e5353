"""gRPC health under churn: statuses set while Watch calls open and close never stop the server (grpcio's own
HealthServicer deadlocks within a second of this, grpc/grpc#43403), and a watcher sees every change in order."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.server.health import HealthServicer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def served() -> Iterator[tuple[HealthServicer, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(8))
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait(5)


def test_setting_statuses_while_watches_close_never_deadlocks(served: tuple[HealthServicer, str]) -> None:
    servicer, target = served
    stop = threading.Event()

    def churn() -> None:  # a Watch that ends right after its first answer: its close runs on gRPC's poller thread
        while not stop.is_set():
            with grpc.insecure_channel(target) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                try:
                    next(watch)
                except grpc.RpcError:
                    pass
                watch.cancel()

    sets = [0]

    def flip() -> None:
        while not stop.is_set():
            servicer.set("", SERVING if sets[0] % 2 else NOT_SERVING)
            sets[0] += 1

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
    threads.append(threading.Thread(target=flip, daemon=True))
    for t in threads:
        t.start()
    try:
        for _ in range(6):
            before = sets[0]
            time.sleep(0.5)
            assert sets[0] > before, f"set() stopped after {sets[0]} calls: deadlocked"
        servicer.enter_graceful_shutdown()  # the teardown that hung a test server
    finally:
        stop.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_a_watcher_sees_each_status_in_order_and_none_after_shutdown(served: tuple[HealthServicer, str]) -> None:
    servicer, target = served
    servicer.set("m", NOT_SERVING)
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="m"), timeout=10)
        assert next(watch).status == NOT_SERVING
        servicer.set("m", SERVING)
        assert next(watch).status == SERVING
        servicer.enter_graceful_shutdown()
        assert next(watch).status == NOT_SERVING
        servicer.set("m", SERVING)  # ignored for good
        check = stub.Check(health_pb2.HealthCheckRequest(service="m"), timeout=5)
        assert check.status == NOT_SERVING
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        watch.cancel()
        unknown.cancel()
