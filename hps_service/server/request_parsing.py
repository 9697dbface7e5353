"""Request bytes that are not the method's protobuf message are refused with INVALID_ARGUMENT, on every method of a
serving process. gRPC answers INTERNAL ("Exception deserializing request!") and logs a stack trace when a request
deserializer raises, so a deserializer here never raises: it returns a :class:`MalformedRequest`, which the
EmbeddingService refuses itself and :func:`tolerant_handler` refuses for the other services (health, reflection)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from hps_service.errors import InvalidArgumentError


class MalformedRequest:
    """Stands for request bytes that are not the expected protobuf message (refused as INVALID_ARGUMENT)."""

    def __init__(self, message_type: str, reason: str) -> None:
        self.message_type = message_type
        self.reason = reason

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"the request is not a valid {self.message_type}: {self.reason}")


class TolerantParser:
    """A request deserializer that returns a MalformedRequest instead of raising."""

    def __init__(self, parse: Callable[[bytes], Any], message_type: str) -> None:
        self._parse = parse
        self.message_type = message_type

    def __call__(self, data: bytes) -> Any:
        try:
            return self._parse(data)
        except Exception as exc:  # protobuf's DecodeError, or whatever a library's deserializer raises
            return MalformedRequest(self.message_type, str(exc) or "undecodable bytes")


def tolerant_parser(message_cls: type[Message]) -> TolerantParser:
    """The tolerant deserializer of ``message_cls``."""
    return TolerantParser(message_cls.FromString, message_cls.DESCRIPTOR.full_name)


def _message_type(deserializer: Callable[[bytes], Any], method: str) -> str:
    """The message a deserializer parses (a generated ``FromString`` is bound to its class), else the method's."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", f"request of {method}"))


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    if isinstance(request, MalformedRequest):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
    return request


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        yield _refuse(request, context)


def tolerant_handler(method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with a deserializer that never raises and a behavior that refuses what it could not parse; a
    handler whose deserializer is a :class:`TolerantParser` already (or that has none) as it is."""
    deserializer = handler.request_deserializer
    if deserializer is None or isinstance(deserializer, TolerantParser):
        return handler
    parser = TolerantParser(deserializer, _message_type(deserializer, method))
    streaming = bool(handler.request_streaming)
    make: Any
    behavior: Any
    if handler.request_streaming and handler.response_streaming:
        make, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    elif handler.request_streaming:
        make, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    elif handler.response_streaming:
        make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    else:
        make, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary

    def checked(argument: Any, context: grpc.ServicerContext, *callback: Any) -> Any:
        argument = _checked(argument, context) if streaming else _refuse(argument, context)
        return behavior(argument, context, *callback)

    for hook in ("experimental_non_blocking", "experimental_thread_pool"):  # gRPC's per-behavior hooks, kept
        if hasattr(behavior, hook):
            setattr(checked, hook, getattr(behavior, hook))
    made: grpc.RpcMethodHandler[Any, Any] = make(checked, request_deserializer=parser,
                                                 response_serializer=handler.response_serializer)
    return made
