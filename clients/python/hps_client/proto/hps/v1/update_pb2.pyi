from hps_client.proto.hps.v1 import rows_pb2 as _rows_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbeddingUpdate(_message.Message):
    __slots__ = ("model", "table", "dim", "keys", "vectors", "versions", "produced_at_ns", "delete_keys", "delete_versions", "purge_tombstones_below", "storage", "model_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    DELETE_KEYS_FIELD_NUMBER: _ClassVar[int]
    DELETE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PURGE_TOMBSTONES_BELOW_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    table: str
    dim: int
    keys: bytes
    vectors: bytes
    versions: bytes
    produced_at_ns: int
    delete_keys: bytes
    delete_versions: bytes
    purge_tombstones_below: int
    storage: _rows_pb2.RowStorage
    model_version: int
    def __init__(self, model: _Optional[str] = ..., table: _Optional[str] = ..., dim: _Optional[int] = ..., keys: _Optional[bytes] = ..., vectors: _Optional[bytes] = ..., versions: _Optional[bytes] = ..., produced_at_ns: _Optional[int] = ..., delete_keys: _Optional[bytes] = ..., delete_versions: _Optional[bytes] = ..., purge_tombstones_below: _Optional[int] = ..., storage: _Optional[_Union[_rows_pb2.RowStorage, str]] = ..., model_version: _Optional[int] = ...) -> None: ...
