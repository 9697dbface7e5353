"""L1 embedding cache: set-associative, one code path for NumPy and CuPy."""

from hps_service.cache.factory import build_table_cache, capacity_rows
from hps_service.cache.protocol import FetchBelow, TableCache
from hps_service.cache.set_assoc import SetAssociativeCache
from hps_service.cache.table_cache import SetAssocTableCache

__all__ = [
    "FetchBelow",
    "SetAssocTableCache",
    "SetAssociativeCache",
    "TableCache",
    "build_table_cache",
    "capacity_rows",
]
