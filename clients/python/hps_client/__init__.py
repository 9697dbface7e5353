"""hps-client: look embedding rows up from hps-service over gRPC (needs only grpcio, protobuf and numpy)."""

from hps_client.aio import AsyncHPSClient
from hps_client.channel import channel_options, channel_target, service_config
from hps_client.client import HPSClient
from hps_client.errors import (
    FailedPreconditionError,
    HPSError,
    InvalidArgumentError,
    LookupError_,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from hps_client.wire import TableAnswer, build_request, decode_answer, encode_keys

__version__ = "0.1.0"

__all__ = [
    "AsyncHPSClient", "FailedPreconditionError", "HPSClient", "HPSError", "InvalidArgumentError", "LookupError_", "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError", "TableAnswer", "UnavailableError", "build_request", "channel_options",
    "channel_target", "decode_answer", "encode_keys", "service_config",
]
