"""hps-client: look embedding rows up from hps-service over gRPC (needs only grpcio, protobuf and numpy)."""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from hps_client import errors as _errors
from hps_client.aio import AsyncHPSClient
from hps_client.aio_coalescing import AsyncCoalescingTransport
from hps_client.attempts import HedgingPolicy
from hps_client.bags import Bags
from hps_client.channel import ACCEPTING_SERVICE, channel_options, channel_target, service_config
from hps_client.client import HPSClient
from hps_client.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    HPSError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StreamLimitError,
    UnauthenticatedError,
    UnavailableError,
)
from hps_client.rows import StoredAnswer, StoredRows
from hps_client.streams import StreamAnswer, StreamRequest
from hps_client.thread_coalescing import CoalescingTransport
from hps_client.transport import AsyncTransport, Transport
from hps_client.wire import TableAnswer, build_request, decode_answer, decode_stored, encode_keys

try:
    __version__ = version("hps-client")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ACCEPTING_SERVICE", "AsyncCoalescingTransport", "AsyncHPSClient", "AsyncTransport", "Bags", "CancelledError",
    "CoalescingTransport", "DeadlineExceededError", "FailedPreconditionError", "HPSClient", "HPSError",
    "HedgingPolicy", "InternalError", "InvalidArgumentError", "NotFoundError", "PermissionDeniedError",
    "ResourceExhaustedError", "StoredAnswer", "StoredRows", "StreamAnswer", "StreamLimitError", "StreamRequest",
    "TableAnswer", "Transport", "UnauthenticatedError", "UnavailableError", "build_request", "channel_options",
    "channel_target", "decode_answer", "decode_stored", "encode_keys", "service_config",
]


def __getattr__(name: str) -> Any:
    """``LookupError_``, the deprecated catch-all (see :mod:`hps_client.errors`)."""
    return _errors.__getattr__(name)
