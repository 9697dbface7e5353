"""A draining gRPC server stops only once its calls answered and their clients had time to read the answers: gRPC
closes a connection the moment its last call ends after GOAWAY, and a client still reading a large answer then gets
a TCP reset instead of it (CI saw ``UNAVAILABLE: Stream removed ... Connection reset by peer`` for a lookup sent
before SIGTERM)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from hps_service.runtime.gate import DRAINING, ServingGate
from hps_service.server.grpc_server import DRAIN_SETTLE_S, HandlerPool, ServingGrpc
from tests.helpers import free_port


def _pool() -> HandlerPool:
    return HandlerPool(lambda _seconds: None, max_workers=2)


def test_an_idle_pool_is_idle_at_once() -> None:
    pool = _pool()
    started = time.monotonic()
    assert pool.wait_idle(settle_s=0.3, timeout_s=5)
    assert time.monotonic() - started < 0.1


def test_wait_idle_waits_for_running_and_queued_calls_then_the_settle() -> None:
    pool = _pool()
    release = threading.Event()
    for _ in range(3):  # two run, one waits for a thread
        pool.submit(release.wait, 10)
    assert not pool.wait_idle(settle_s=0.2, timeout_s=0.2)
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    assert pool.wait_idle(settle_s=0.3, timeout_s=5)
    assert time.monotonic() - started >= 0.2 + 0.3 - 0.02
    pool.shutdown()


def test_a_call_that_raises_is_answered_too() -> None:
    pool = _pool()
    future = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        future.result(5)
    assert pool.wait_idle(settle_s=0.05, timeout_s=5)


def test_wait_idle_gives_up_at_its_timeout() -> None:
    pool = _pool()
    release = threading.Event()
    pool.submit(release.wait, 10)
    started = time.monotonic()
    assert not pool.wait_idle(settle_s=0.0, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 1.0
    release.set()
    pool.shutdown()


def test_drain_and_stop_answers_through_its_lame_duck_then_refuses_and_lets_clients_read() -> None:
    """A call sent while the server drains is answered (the gate is still open); the server stops only once its
    last answer had the settle to be read, and the gate is closed when it returns."""
    pool = _pool()
    server = grpc.server(pool)
    gate = ServingGate()
    gate.open()
    answered_at: list[float] = []

    def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(0.3)
        answered_at.append(time.monotonic())
        return b"x" * (8 << 20)

    def small(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"open" if gate.is_open else b"refused"

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Slow": grpc.unary_unary_rpc_method_handler(slow),
                "Small": grpc.unary_unary_rpc_method_handler(small)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 16 << 20)])
    result: list[bytes] = []
    caller = threading.Thread(target=lambda: result.append(channel.unary_unary("/t.T/Slow")(b"", timeout=10)))
    caller.start()
    deadline = time.monotonic() + 10
    while pool.wait_idle(0, 0) and time.monotonic() < deadline:  # until the call reached the server's pool
        time.sleep(0.005)
    gate.begin_draining()
    drainer = threading.Thread(target=ServingGrpc(server, pool).drain_and_stop, args=(gate, 6.0))
    drainer.start()
    assert channel.unary_unary("/t.T/Small")(b"", timeout=10) == b"open"
    drainer.join(10)
    stopped_at = time.monotonic()
    caller.join(10)
    channel.close()
    assert result and len(result[0]) == 8 << 20
    assert stopped_at - answered_at[0] >= DRAIN_SETTLE_S - 0.02
    assert not gate.is_open and gate.reason == DRAINING
