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
