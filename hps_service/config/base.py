"""What every config section shares: unknown keys are refused, and the pattern of model, table and reader names."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[A-Za-z0-9_\-]{1,64}$"
NAME_RE = re.compile(NAME_PATTERN)


class Section(BaseModel):
    """A config section: a key it does not know is a mistake, reported rather than ignored."""

    model_config = ConfigDict(extra="forbid")

#: How a table's rows are stored in every tier (see :mod:`hps_service.rows.formats`).
Storage = Literal["fp32", "fp16", "bf16", "int8"]


#: Separates a model's name from its version in the name its tables are served under (never in a model name).
VERSION_MARK = "#v"


def served_name(model: str, version: int) -> str:
    """The name version ``version`` of ``model`` is served and stored under (0: the model as configured)."""
    return f"{model}{VERSION_MARK}{version}" if version else model


def split_served(name: str) -> tuple[str, int]:
    """``(model, version)`` of a served name (see :func:`served_name`); a name no model may have (a request's, with
    the mark but no version after it) is itself, version 0."""
    model, mark, version = name.rpartition(VERSION_MARK)
    return (model, int(version)) if mark and version.isascii() and version.isdigit() else (name, 0)
