"""A version's drop, made safe against a crash half-way: an intent marker in the persistent tier's metadata.

Dropping a version stops serving it, then frees its tables one by one (column families, hash-map tables, Redis
keys), and only after that is its stored registration forgotten (:mod:`hps_service.fleet.registrations`). A process
that died in between would serve the version again after its restart, its tables already freed answering defaults.
So :meth:`LookupEngine.drop_version` first writes ``dropping:<served name>`` with the version's table ids; the
marker is cleared with the registration, and a start that finds one finishes the drop instead of serving the
version (:func:`hps_service.fleet.registrations.serve_registered`).
"""

from __future__ import annotations

import json
import logging

from hps_service.tiers.base import Tier, TierCapability, tier_can

log = logging.getLogger(__name__)

_PREFIX = "dropping:"


def dropping_key(name: str) -> str:
    """The metadata entry that marks the served name ``name`` as being dropped."""
    return _PREFIX + name


def mark(tier: Tier | None, name: str, tables: dict[str, str]) -> None:
    """Mark ``name`` as being dropped, with its tables (table name -> tier id); nothing without a persistent tier."""
    if tier_can(tier, TierCapability.WRITES):
        tier.set_metadata(dropping_key(name), json.dumps(tables, sort_keys=True).encode())


def clear(tier: Tier | None, name: str) -> None:
    """Forget the mark of ``name`` (its drop is complete, or its rows are wanted again)."""
    key = dropping_key(name)
    if tier_can(tier, TierCapability.WRITES) and key in tier.metadata(key):
        tier.set_metadata(key, None)


def pending(tier: Tier | None) -> dict[str, dict[str, str]]:
    """The marked served names and their tables (table name -> tier id); a mark that does not parse has none."""
    if tier is None:
        return {}
    out: dict[str, dict[str, str]] = {}
    for key, value in tier.metadata(_PREFIX).items():
        try:
            tables = json.loads(value)
        except ValueError:
            log.warning("the drop mark %s does not parse; its tables are left as they are", key)
            tables = {}
        out[key[len(_PREFIX):]] = {str(k): str(v) for k, v in tables.items()} if isinstance(tables, dict) else {}
    return out
