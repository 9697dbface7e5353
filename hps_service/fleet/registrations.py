"""Models registered at runtime (REST ``POST /v1/models``), kept in the persistent tier's metadata so that they are
served again after a restart, and travel with a snapshot of the model."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable

from pydantic import ValidationError

from hps_service.config import ModelConfig
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)

_PREFIX = "model:"


def registration_key(model: str) -> str:
    """The metadata key of a model's registration."""
    return _PREFIX + model


def save_registration(tier: Tier | None, model: ModelConfig) -> bool:
    """Persist ``model``; False when there is no store that keeps metadata (it then lasts until the restart)."""
    if tier is None:
        return False
    return tier.set_metadata(registration_key(model.name), model.model_dump_json().encode())


def forget_registration(tier: Tier | None, model: str) -> None:
    """Drop a persisted registration (the model was unloaded)."""
    key = registration_key(model)
    if tier is not None and key in tier.metadata(key):
        tier.set_metadata(key, None)


def load_registrations(tier: Tier | None) -> list[ModelConfig]:
    """Every persisted registration that still parses (others are logged and skipped)."""
    if tier is None:
        return []
    out = []
    for key, value in tier.metadata(_PREFIX).items():
        try:
            out.append(ModelConfig.model_validate(json.loads(value)))
        except (ValueError, ValidationError) as exc:
            log.warning("ignoring the stored registration %s: %s", key, str(exc).replace("\n", " "))
    return out


def sync_registrations(tier: Tier | None, configured: Collection[str], loaded: Iterable[ModelConfig]) -> None:
    """Persist the loaded models the config does not define, and forget the stored ones no longer loaded."""
    if tier is None:
        return
    by_name = {m.name: m for m in loaded}
    for name, model in by_name.items():
        if name not in configured:
            save_registration(tier, model)
    for model in load_registrations(tier):
        if model.name not in by_name:
            forget_registration(tier, model.name)
