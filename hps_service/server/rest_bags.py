"""The REST form of a pooled lookup (``POST .../embeddings:lookup`` with ``offsets`` and ``combiner``): the bags
checked as gRPC checks them, one row answered per bag."""

from __future__ import annotations

from typing import Any

import numpy as np

from hps_service.engine.api import ReadEngine
from hps_service.engine.bags import COMBINERS, Bags, check_bags
from hps_service.errors import InvalidArgumentError


def body_bags(body: Any, n_keys: int, max_bags: int) -> Bags | None:
    """The bags a lookup body names (None: a plain lookup); InvalidArgumentError naming the field."""
    if body.combiner is None:
        if body.offsets is not None or body.weights is not None:
            raise InvalidArgumentError("offsets and weights need a combiner (sum or mean)")
        return None
    if body.offsets is None:
        raise InvalidArgumentError("a pooled lookup (combiner) needs offsets: each bag's start in keys")
    weights = None if body.weights is None else np.array(body.weights, dtype=np.float32)
    return check_bags(n_keys, np.array(body.offsets, dtype=np.int64), COMBINERS[body.combiner], weights, max_bags)


def pooled_answer(engine: ReadEngine, served: str, model: str, version: int | None, table: str, keys: np.ndarray,
                  bags: Bags, source_names: np.ndarray) -> dict[str, Any]:
    """The JSON answer of a pooled lookup: one row per bag and the deepest level that answered each."""
    result = engine.lookup_bags(served, table, keys, bags)
    return {"model": model, "model_version": version, "version": version, "table": table, "dim": int(result.vectors.shape[1]),
            "bags": bags.count, "vectors": result.vectors.tolist(), "sources": source_names[result.sources].tolist()}
