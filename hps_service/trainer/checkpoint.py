"""Training checkpoints: ``DIR/step-<step>/`` with the dense state, each rank's embedding shard, and the position.

``dense.pt`` (rank 0): the tower's weights and buffers (the expert bias among them), Adam and its schedule, the loss
scaler. ``tables-rank<r>.safetensors``: the rows rank r owns with their Adagrad accumulators, last-use steps and
publish flags, and its admission sketch. ``meta.json``: step, generation, data position, world size, table dims. A checkpoint is written in a
hidden directory and renamed when complete, so a crash mid-write leaves the previous one as the newest. Loading
reads every shard and keeps the rows the loading rank owns, so a run may resume on another number of processes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.tables import EmbeddingTable

_PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:012d}"


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    if not directory.is_dir():
        return None
    done = sorted(p for p in directory.iterdir() if p.name.startswith(_PREFIX) and (p / "meta.json").is_file())
    return done[-1] if done else None


def staging_dir(directory: Path, step: int) -> Path:
    return directory / f".{checkpoint_name(step)}.partial"


def write_tables(
    path: Path, rank: int, tables: Mapping[str, EmbeddingTable],
    unacknowledged: Callable[[str], tuple[np.ndarray, np.ndarray]] | None = None,
) -> None:
    """This rank's rows of every table, in one safetensors file; ``unacknowledged(table)``: (keys, delete keys)
    handed to a publish not yet acknowledged, stored as still to publish."""
    arrays: dict[str, np.ndarray] = {}
    for name, table in tables.items():
        for field, arr in table.state(unacknowledged(name) if unacknowledged else None).items():
            arrays[f"{name}/{field}"] = np.ascontiguousarray(arr)
    save_file(arrays, str(path / f"tables-rank{rank}.safetensors"))


def write_dense(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Rank 0's part: dense state and the metadata (``meta.json`` last: it marks the files complete)."""
    torch.save(state, path / "dense.pt")
    (path / "meta.json").write_text(json.dumps(meta, indent=2))


def publish_checkpoint(directory: Path, step: int, keep: int) -> Path:
    """Rename the staged checkpoint into place and drop all but the newest ``keep``."""
    final = directory / checkpoint_name(step)
    if final.exists():
        shutil.rmtree(final)
    staging_dir(directory, step).rename(final)
    done = sorted(p for p in directory.iterdir() if p.name.startswith(_PREFIX))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def read_dense(path: Path) -> dict[str, Any]:
    return torch.load(path / "dense.pt", map_location="cpu", weights_only=True)


def load_tables(
    path: Path, tables: Mapping[str, EmbeddingTable], owns: Callable[[np.ndarray], np.ndarray] | None = None
) -> None:
    """Fill empty ``tables`` with the rows of every shard that this rank owns (``owns(keys)`` -> bool mask)."""
    shards = sorted(path.glob("tables-rank*.safetensors"))
    if not shards:
        raise InvalidArgumentError(f"checkpoint {path} holds no table shards")
    merged: dict[str, dict[str, list[np.ndarray]]] = {name: {} for name in tables}
    for shard in shards:
        arrays = load_file(str(shard))
        for key, arr in arrays.items():
            name, field = key.split("/", 1)
            if name in merged:
                merged[name].setdefault(field, []).append(arr)
    for name, table in tables.items():
        sketches = merged[name].pop("sketch", [])  # one per rank, of disjoint keys: they add up
        fields = {f: np.concatenate(parts) for f, parts in merged[name].items()}
        if "keys" not in fields:
            raise InvalidArgumentError(f"checkpoint {path} has no rows for table {name!r}")
        mask = owns(fields["keys"]) if owns is not None else np.ones(fields["keys"].size, dtype=bool)
        state = {f: v[mask] for f, v in fields.items() if f != "deletes"}
        deletes = fields.get("deletes", np.zeros(0, dtype=np.int64))
        state["deletes"] = deletes[owns(deletes)] if owns is not None and deletes.size else deletes
        state["sketches"] = sketches
        table.load_state(state)
