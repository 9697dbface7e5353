from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class RowStorage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_STORAGE_FP32: _ClassVar[RowStorage]
    ROW_STORAGE_FP16: _ClassVar[RowStorage]
    ROW_STORAGE_BF16: _ClassVar[RowStorage]
    ROW_STORAGE_INT8: _ClassVar[RowStorage]
ROW_STORAGE_FP32: RowStorage
ROW_STORAGE_FP16: RowStorage
ROW_STORAGE_BF16: RowStorage
ROW_STORAGE_INT8: RowStorage
