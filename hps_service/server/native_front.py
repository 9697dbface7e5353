"""``server.front: native``: a worker's public gRPC port served by pygrpc-native (the ``native`` extra), whose HTTP/2
and gRPC run in Rust threads outside the GIL and hand calls to Python in batches.

One Python thread takes the ``Lookup`` calls a batch at a time and answers each through the servicer's own
:meth:`~hps_service.server.grpc_service.EmbeddingServicer.serve_one` (the same checks, auth, deadline, counters, error
statuses and response bytes as under grpcio). Every other method (StreamLookup, whose requests stream, which 0.5 does
not serve natively; ListModels, GetModel, GetClusterInfo, health, reflection) passes to the worker's grpcio server,
which listens on a Unix socket of its own behind the front. What the front cannot do (TLS, connection age, tracing's
interceptors) the config refuses (``ServerConfig._native_front``). One difference remains: a request over a limit
is refused RESOURCE_EXHAUSTED without gRPC's retry pushback (``grpc-retry-pushback-ms``, a key pygrpc-native reserves),
so a client's retry policy may ask again before it gives up.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import grpc

from hps_service.config import HPSConfig
from hps_service.errors import ResourceExhaustedError, UnavailableError
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.server.grpc_server import ServingGrpc, message_limits
from hps_service.server.grpc_service import EmbeddingServicer, refusal
from hps_service.server.request_parsing import tolerant_parser

log = logging.getLogger(__name__)

LOOKUP = "/hps.v1.EmbeddingService/Lookup"
#: Calls taken from the front at a time.
BATCH = 64


class _CallContext:
    """What the servicer asks of a call's context (its deadline, metadata and peer), for a call of the front."""

    __slots__ = ("_metadata", "_peer", "_deadline")

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]], peer: str, remaining: float | None,
                 received: float) -> None:
        self._metadata = metadata
        self._peer = peer
        self._deadline = None if remaining is None else received + remaining

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}  # no TLS on this front


def require_native() -> Any:
    """The pygrpc_native module, or UnavailableError saying how to install it."""
    try:
        import pygrpc_native
    except ImportError:
        raise UnavailableError("server.front native needs pygrpc-native: pip install 'hps-service[native]'") from None
    return pygrpc_native


class NativeFront:
    """One worker's port served by pygrpc-native (see the module docstring)."""

    def __init__(self, config: HPSConfig, servicer: EmbeddingServicer, address: str, fallback: str,
                 max_receive_bytes: int, directory: Path | None = None) -> None:
        """``address``: host:port to bind (shared with the sibling workers); ``fallback``: the Unix socket path of
        the grpcio server behind the front, in ``directory`` (removed at :meth:`close`)."""
        native = require_native()
        cfg = config.server
        self._servicer = servicer
        self._receive = max_receive_bytes
        self._call = native.EVENT_CALL
        self._parse = tolerant_parser(pb.LookupRequest)
        self._front = native.NativeGrpcFront(
            address, [(LOOKUP, False)], io_threads=2, call_details=True, reuse_port=True,
            keepalive_time_ms=int(cfg.keepalive_time_s * 1000), keepalive_timeout_ms=int(cfg.keepalive_timeout_s * 1000),
            keepalive_permit_without_calls=True, max_concurrent_streams=cfg.max_calls_per_connection)
        self._front.set_fallback(fallback)
        self._directory = directory
        self.bound_port: int = self._front.bound_port
        self._lock = threading.Lock()
        self._unanswered = 0
        self._last_answer = 0.0
        self._thread = threading.Thread(target=self._serve, name="hps-native-front", daemon=True)

    def start(self) -> None:
        self._front.start()
        self._thread.start()

    def _serve(self) -> None:
        front, call = self._front, self._call
        while (events := front.recv_batch_details(BATCH)) is not None:
            received = time.monotonic()
            with self._lock:
                self._unanswered += len(events)
            for kind, call_id, _method, payload, _key, details in events:
                try:
                    if kind == call and payload is not None and details is not None:
                        self._answer(call_id, payload, details, received)
                except Exception:  # the call is failed below; the lane goes on
                    log.exception("the native front could not answer call %d", call_id)
                    front.fail(call_id, grpc.StatusCode.INTERNAL.value[0], "internal error; see the server log")
                finally:
                    with self._lock:
                        self._unanswered -= 1
                        self._last_answer = time.monotonic()

    def _answer(self, call_id: int, payload: bytes, details: tuple[Any, str, float | None], received: float) -> None:
        metadata, peer, remaining = details
        context = cast(grpc.ServicerContext, _CallContext(metadata, peer, remaining, received))
        try:
            if len(payload) > self._receive:
                raise ResourceExhaustedError(f"Received message larger than max ({len(payload)} vs. {self._receive})")
            answer = self._servicer.serve_one("Lookup", self._parse(payload), context)
        except Exception as err:
            code, message, _ = refusal(err)  # gRPC's retry pushback is a reserved key the front may not send
            self._front.fail(call_id, code.value[0], message)
            return
        self._front.respond(call_id, answer)

    def is_idle(self, settle_s: float) -> bool:
        """No call is unanswered, and the last answer went out ``settle_s`` ago (see ``HandlerPool.is_idle``)."""
        with self._lock:
            return self._unanswered == 0 and time.monotonic() - self._last_answer >= settle_s

    def close(self) -> None:
        """Stop serving (calls still in the front are answered UNAVAILABLE by it) and end the thread."""
        self._front.close()
        self._thread.join(5)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


def serve_behind(serving: ServingGrpc, config: HPSConfig, servicer: EmbeddingServicer, address: str) -> int:
    """Bind ``serving``'s grpcio server to a Unix socket of its own and put a :class:`NativeFront` on ``address``
    before it (started with it: ``serving.front``); returns the port the front bound."""
    directory = Path(tempfile.mkdtemp(prefix="hps-front-"))
    path = directory / "grpc.sock"
    serving.server.add_insecure_port(f"unix:{path}")
    front = NativeFront(config, servicer, address, str(path), message_limits(config)[0], directory)
    serving.front = front
    return front.bound_port
