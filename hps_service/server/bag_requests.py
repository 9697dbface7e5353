"""The bags of a pooled LookupRequest (``TableKeys.offsets``, ``combiner``, ``weights``), read from their packed
bytes and checked (:func:`hps_service.engine.bags.check_bags`), every error naming the table and the field."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hps_service.engine.bags import Bags, check_bags
from hps_service.errors import InvalidArgumentError, ResourceExhaustedError
from hps_service.proto.hps.v1 import embedding_pb2 as pb


def request_bags(tables: Sequence[pb.TableKeys], keys: Sequence[bytes], max_bags: int) -> list[Bags | None] | None:
    """Per table, its checked bags (None: a plain table); None when no table of the request is pooled (one
    few attribute tests per table on the usual request). Bags of every table together are at most ``max_bags``."""
    if not any(tk.combiner or tk.offsets or tk.weights for tk in tables):
        return None
    out: list[Bags | None] = []
    total = 0
    for tk, raw in zip(tables, keys):
        if not tk.combiner:
            if tk.offsets or tk.weights:
                raise InvalidArgumentError(f"table '{tk.table}': offsets and weights need a combiner (SUM or MEAN)")
            out.append(None)
            continue
        offsets, weights = tk.offsets, tk.weights
        if len(offsets) % 8:
            raise InvalidArgumentError(f"table '{tk.table}': offsets is {len(offsets)} bytes, not a multiple of 8 "
                                       "(packed int64)")
        if len(weights) % 4:
            raise InvalidArgumentError(f"table '{tk.table}': weights is {len(weights)} bytes, not a multiple of 4 "
                                       "(packed float32)")
        bags = check_bags(len(raw) // 8, np.frombuffer(offsets, dtype="<i8"), int(tk.combiner),
                          np.frombuffer(weights, dtype="<f4") if weights else None, max_bags, f"table '{tk.table}'")
        total += bags.count
        if total > max_bags:
            raise ResourceExhaustedError(f"{total} bags in one request exceeds server.max_batch_keys={max_bags}")
        out.append(bags)
    return out
