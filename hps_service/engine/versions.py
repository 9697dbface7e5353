"""Model versions and their labels: which version a lookup names, and which versions retention drops.

A version of a model is served beside it under its own name (``ctr#v13``, see
:func:`hps_service.config.base.served_name`), so its tables have their own tier ids, L1 share and hash-map entries.
A label names a version (``production`` -> 13; 0 names the model as configured). A request names a version, a
label, or neither (the label ``production`` when it is set, else the model as configured); it is resolved once,
so every table of the request is answered from the same version. Labels are replaced copy-on-write: a reader sees
the labels before a switch or after it, never a mix.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping

from hps_service.config import ModelConfig
from hps_service.config.base import NAME_RE, served_name
from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.tiers.base import Tier

#: The label a request that names no version and no label reads.
DEFAULT_LABEL = "production"
_LABEL_PREFIX = "label:"

#: model -> label -> version
LabelMap = Mapping[str, Mapping[str, int]]


def check_label(label: str) -> str:
    """``label`` if it is a valid name (the pattern of model and table names), else InvalidArgumentError."""
    if not NAME_RE.match(label):
        raise InvalidArgumentError(f"label {label[:80]!r} is not a name of 1-64 letters, digits, '_' or '-'")
    return label


def resolve(labels: LabelMap, served: Collection[str], model: str, version: int | None = None,
            label: str = "") -> tuple[str, int]:
    """``(served name, version)`` that a request for ``model`` with ``version`` (0: the model as configured; None:
    none named) or ``label`` reads; NotFoundError naming what is missing, InvalidArgumentError for a request that
    names both."""
    if version is not None:
        if label:
            raise InvalidArgumentError(f"the request names version {version} and label '{label}': name one")
        name = served_name(model, version)
        if version and name not in served:
            raise NotFoundError(f"model '{model}' has no version {version} loaded")
        return name, version
    by_label = labels.get(model)
    named = 0
    if label:
        if by_label is None or label not in by_label:
            check_label(label)
            raise NotFoundError(f"model '{model}' has no label '{label}'")
        named = by_label[label]
    elif by_label is not None:
        named = by_label.get(DEFAULT_LABEL, 0)
    return served_name(model, named), named


class Labels:
    """The labels of every model, replaced whole on each change (lock-free reads)."""

    def __init__(self, initial: LabelMap | None = None) -> None:
        self._map: dict[str, dict[str, int]] = {m: dict(ls) for m, ls in (initial or {}).items()}
        self._lock = threading.Lock()

    def current(self) -> LabelMap:
        """model -> label -> version, as of now."""
        return self._map

    def of(self, model: str) -> dict[str, int]:
        """The labels of ``model``."""
        return dict(self._map.get(model, {}))

    def point(self, model: str, label: str, version: int | None) -> int | None:
        """Point ``label`` of ``model`` at ``version`` (None: remove it); returns the version it named before."""
        with self._lock:
            labels = dict(self._map.get(model, {}))
            before = labels.pop(label, None) if version is None else labels.get(label)
            if version is not None:
                labels[label] = version
            self._map = {**{m: ls for m, ls in self._map.items() if m != model}, **({model: labels} if labels else {})}
        return before

    def labelled(self, model: str) -> set[int]:
        """The versions of ``model`` that some label names."""
        return set(self._map.get(model, {}).values())


def to_drop(versions: list[ModelConfig], labelled: set[int], keep: int) -> list[ModelConfig]:
    """The versions retention drops: all but the ``keep`` newest unlabelled ones (a labelled one is never dropped)."""
    unlabelled = sorted((v for v in versions if v.version not in labelled), key=lambda v: v.version)
    return unlabelled[: max(0, len(unlabelled) - keep)]


def label_key(model: str, label: str) -> str:
    """The persistent tier's metadata entry of a label."""
    return f"{_LABEL_PREFIX}{model}/{label}"


def save_label(tier: Tier | None, model: str, label: str, version: int | None) -> None:
    """Persist a label (None: forget it), so that a restart serves the same versions."""
    if tier is not None:
        tier.set_metadata(label_key(model, label), None if version is None else str(version).encode())


def label_keys(tier: Tier, model: str) -> list[str]:
    """The metadata entries of ``model``'s labels in ``tier`` (a snapshot of the model carries them)."""
    return list(tier.metadata(f"{_LABEL_PREFIX}{model}/"))


def load_labels(tier: Tier | None) -> dict[str, dict[str, int]]:
    """The persisted labels: model -> label -> version (entries that do not parse are skipped)."""
    out: dict[str, dict[str, int]] = {}
    if tier is None:
        return out
    for key, value in tier.metadata(_LABEL_PREFIX).items():
        model, _, label = key[len(_LABEL_PREFIX):].partition("/")
        try:
            version = int(value)
        except ValueError:
            continue
        if NAME_RE.match(model) and NAME_RE.match(label) and version >= 0:
            out.setdefault(model, {})[label] = version
    return out
