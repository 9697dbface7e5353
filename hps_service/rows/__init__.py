"""Row formats: how a table's float32 rows are stored (fp32, fp16, bf16, int8) and turned back into float32."""

from hps_service.config.base import Storage
from hps_service.rows.formats import STORAGES, RowFormat, row_format, storage_key

__all__ = ["STORAGES", "RowFormat", "Storage", "row_format", "storage_key"]
