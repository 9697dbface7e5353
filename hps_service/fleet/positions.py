"""Log positions as they travel in snapshot manifests and readiness reports: ``(source, partition) -> next offset``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hps_service.tiers.base import Positions


def positions_to_json(positions: Positions) -> list[dict[str, Any]]:
    """``[{"source", "partition", "offset"}]`` sorted by source and partition."""
    return [{"source": s, "partition": p, "offset": int(o)} for (s, p), o in sorted(positions.items())]


def positions_from_json(entries: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], int]:
    """The inverse of :func:`positions_to_json`; ValueError on a malformed entry."""
    out: dict[tuple[str, int], int] = {}
    for e in entries:
        source, partition, offset = e["source"], e["partition"], e["offset"]
        if not isinstance(source, str) or not isinstance(partition, int) or not isinstance(offset, int):
            raise ValueError(f"malformed position entry {dict(e)!r}")
        out[(source, partition)] = offset
    return out
