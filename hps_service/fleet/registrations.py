"""Models and model versions registered at runtime (REST ``POST /v1/models``, ``POST /v1/models/{m}/versions``),
kept in the persistent tier's metadata under their served names so that they are served again after a restart, and
travel with a snapshot of the model."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable
from typing import Any

from pydantic import ValidationError

from hps_service.config import ModelConfig
from hps_service.engine import version_drop
from hps_service.engine.registry import described
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)

_PREFIX = "model:"


def registration_key(model: str) -> str:
    """The metadata key of the registration of a served name (a model, or ``model#vN``)."""
    return _PREFIX + model


def save_registration(tier: Tier | None, model: ModelConfig) -> bool:
    """Persist ``model``; False when there is no store that keeps metadata (it then lasts until the restart)."""
    if tier is None:
        return False
    return tier.set_metadata(registration_key(model.served_name), model.model_dump_json().encode())


def forget_registration(tier: Tier | None, model: str) -> None:
    """Drop a persisted registration (the model was unloaded), then the mark of its drop (a version's, see
    :mod:`hps_service.engine.version_drop`): a start between the two finds the mark alone and finishes the drop."""
    key = registration_key(model)
    if tier is not None and key in tier.metadata(key):
        tier.set_metadata(key, None)
    version_drop.clear(tier, model)


def load_registrations(tier: Tier | None) -> list[ModelConfig]:
    """Every persisted registration that still parses (others are logged and skipped), each model before its
    versions."""
    if tier is None:
        return []
    out = []
    for key, value in tier.metadata(_PREFIX).items():
        try:
            out.append(ModelConfig.model_validate(json.loads(value)))
        except (ValueError, ValidationError) as exc:
            log.warning("ignoring the stored registration %s: %s", key, str(exc).replace("\n", " "))
    return sorted(out, key=lambda m: (m.version, m.name))


def sync_registrations(tier: Tier | None, configured: Collection[str], loaded: Iterable[ModelConfig]) -> None:
    """Persist the loaded models and versions (``loaded``) the config does not define, and forget the stored ones
    no longer loaded."""
    if tier is None:
        return
    by_name = {m.served_name: m for m in loaded}
    for name, model in by_name.items():
        if name not in configured:
            save_registration(tier, model)
    for model in load_registrations(tier):
        if model.served_name not in by_name:
            forget_registration(tier, model.served_name)


def finish_drops(engine: Any, configured: Collection[str]) -> list[str]:
    """Finish, on ``engine`` (an Engine, before it serves what was registered), the drops of versions that a
    stop interrupted (their marks): their remaining tables are freed and their registrations forgotten, so they are
    not served again. A version the config defines keeps its tables (the config wins); its mark is cleared. Returns
    the served names whose drop was finished."""
    finished = []
    for name, tables in version_drop.pending(engine.persistent).items():
        if name in configured:
            log.warning("%s is defined by the config: its interrupted drop is not finished", described(name))
            version_drop.clear(engine.persistent, name)
            continue
        freed = engine.finish_drop(name, tables)
        forget_registration(engine.persistent, name)
        log.info("%s: its drop, interrupted before the restart, is finished (%s)", described(name),
                 ", ".join(f"{t}: {n} rows" for t, n in freed.items()) or "no tables")
        finished.append(name)
    return finished


def serve_registered(engine: Any, configured: Collection[str]) -> None:
    """Serve again, on ``engine`` (an Engine), the models and versions registered at runtime before a restart
    (those the config defines excepted: the config wins), each model before its versions; versions whose drop a
    stop interrupted are dropped instead (:func:`finish_drops`)."""
    finish_drops(engine, configured)
    for model in load_registrations(engine.persistent):
        if model.served_name in configured:
            log.warning("model %s is defined by the config; its stored runtime registration is ignored", model.name)
            continue
        log.info("%s: registered at runtime before the restart", described(model.served_name))
        engine.register_model(model)
