"""The Python client, re-exported from the client-only distribution ``hps-client`` (import ``hps_client``), so
``from hps_service.client import HPSClient`` keeps working."""

from typing import Any

from hps_client import errors as _errors
from hps_client.channel import BARE_OPTIONS as _CHANNEL_OPTIONS
from hps_client.client import HPSClient
from hps_client.tls import channel_credentials
from hps_client.wire import TableAnswer, build_request, decode_answer, encode_keys

__all__ = ["HPSClient", "TableAnswer", "_CHANNEL_OPTIONS", "build_request", "channel_credentials",
           "decode_answer", "encode_keys"]


def __getattr__(name: str) -> Any:
    """``LookupError_``, the client's deprecated catch-all."""
    return _errors.__getattr__(name)
