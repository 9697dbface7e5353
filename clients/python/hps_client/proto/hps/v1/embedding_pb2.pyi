from hps_client.proto.hps.v1 import rows_pb2 as _rows_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_UNSPECIFIED: _ClassVar[Source]
    SOURCE_CACHE: _ClassVar[Source]
    SOURCE_VOLATILE: _ClassVar[Source]
    SOURCE_PERSISTENT: _ClassVar[Source]
    SOURCE_DEFAULT: _ClassVar[Source]
    SOURCE_EXPIRED: _ClassVar[Source]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_FP32: _ClassVar[Precision]
    PRECISION_STORED: _ClassVar[Precision]

class Combiner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMBINER_UNSPECIFIED: _ClassVar[Combiner]
    COMBINER_SUM: _ClassVar[Combiner]
    COMBINER_MEAN: _ClassVar[Combiner]
SOURCE_UNSPECIFIED: Source
SOURCE_CACHE: Source
SOURCE_VOLATILE: Source
SOURCE_PERSISTENT: Source
SOURCE_DEFAULT: Source
SOURCE_EXPIRED: Source
PRECISION_FP32: Precision
PRECISION_STORED: Precision
COMBINER_UNSPECIFIED: Combiner
COMBINER_SUM: Combiner
COMBINER_MEAN: Combiner

class TableKeys(_message.Message):
    __slots__ = ("table", "keys", "offsets", "combiner", "weights")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    COMBINER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    offsets: bytes
    combiner: Combiner
    weights: bytes
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., combiner: _Optional[_Union[Combiner, str]] = ..., weights: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model", "tables", "request_id", "precision", "version", "label")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    tables: _containers.RepeatedCompositeFieldContainer[TableKeys]
    request_id: int
    precision: Precision
    version: int
    label: str
    def __init__(self, model: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableKeys, _Mapping]]] = ..., request_id: _Optional[int] = ..., precision: _Optional[_Union[Precision, str]] = ..., version: _Optional[int] = ..., label: _Optional[str] = ...) -> None: ...

class TableVectors(_message.Message):
    __slots__ = ("table", "dim", "count", "vectors", "sources", "storage", "pooled")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    count: int
    vectors: bytes
    sources: bytes
    storage: _rows_pb2.RowStorage
    pooled: bool
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., count: _Optional[int] = ..., vectors: _Optional[bytes] = ..., sources: _Optional[bytes] = ..., storage: _Optional[_Union[_rows_pb2.RowStorage, str]] = ..., pooled: bool = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("model", "tables", "request_id", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    tables: _containers.RepeatedCompositeFieldContainer[TableVectors]
    request_id: int
    version: int
    def __init__(self, model: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableVectors, _Mapping]]] = ..., request_id: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "dim")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "tables")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, name: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("shards", "shard", "partitions", "partitioner", "owned_partitions", "topic_partitions", "ready", "not_ready")
    class TopicPartitionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONER_FIELD_NUMBER: _ClassVar[int]
    OWNED_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_FIELD_NUMBER: _ClassVar[int]
    shards: int
    shard: int
    partitions: int
    partitioner: str
    owned_partitions: _containers.RepeatedScalarFieldContainer[int]
    topic_partitions: _containers.ScalarMap[str, int]
    ready: bool
    not_ready: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shards: _Optional[int] = ..., shard: _Optional[int] = ..., partitions: _Optional[int] = ..., partitioner: _Optional[str] = ..., owned_partitions: _Optional[_Iterable[int]] = ..., topic_partitions: _Optional[_Mapping[str, int]] = ..., ready: bool = ..., not_ready: _Optional[_Iterable[str]] = ...) -> None: ...
