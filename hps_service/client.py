"""The Python client, re-exported from the client-only distribution ``hps-client`` (import ``hps_client``), so
``from hps_service.client import HPSClient`` keeps working."""

from hps_client.channel import BARE_OPTIONS as _CHANNEL_OPTIONS
from hps_client.client import HPSClient
from hps_client.errors import LookupError_
from hps_client.tls import channel_credentials
from hps_client.wire import TableAnswer, build_request, decode_answer, encode_keys

__all__ = ["HPSClient", "LookupError_", "TableAnswer", "_CHANNEL_OPTIONS", "build_request", "channel_credentials",
           "decode_answer", "encode_keys"]
