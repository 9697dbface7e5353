"""The lookup engine: the hierarchy L1 cache -> volatile tier -> persistent tier -> default vector.

It knows nothing of gRPC or HTTP. One module per job: ``registry`` (loaded models and tables), ``table`` (one
served table), ``read`` (lookups, fetches below L1), ``promote`` (L3 rows into L2 without resurrecting deletes),
``write`` (upserts, deletes, purges), ``convert`` (a table re-encoded in another format while served) and
``stored_tables`` (where its rows live), ``preload``, ``repair``, ``stats``; ``engine`` is the facade over them.
"""

from hps_service.engine.engine import LookupEngine
from hps_service.engine.levels import LEVELS, NO_ROW_VERSION, Fetched, LookupResult, Source
from hps_service.engine.table import CacheFactory, ServedTable
from hps_service.engine.write import TableChange, as_rows, latest_per_key, resolve_latest

__all__ = [
    "LEVELS",
    "NO_ROW_VERSION",
    "CacheFactory",
    "Fetched",
    "LookupEngine",
    "LookupResult",
    "ServedTable",
    "Source",
    "TableChange",
    "as_rows",
    "latest_per_key",
    "resolve_latest",
]
