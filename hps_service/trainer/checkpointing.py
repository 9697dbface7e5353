"""Saving and resuming a Trainer: what a checkpoint records, and what a resume must publish again.

A checkpoint stores the rows with a flag per row saying whether the server may lack its current value: rows
changed since the last publish, and rows of publishes handed over but not yet acknowledged by the broker (a
checkpoint records only what was acknowledged as published). It stores the input position, which is committed to
the source (Kafka offsets) only after the checkpoint is complete. A resume publishes those rows again, and also
every key the interrupted run published after the checkpoint (from the publish journal: the server may hold
versions of steps the resumed run has not trained), the ones it no longer holds as deletes. A resume with a model
of another shape is refused with the difference.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from hps_service.errors import FailedPreconditionError
from hps_service.trainer import checkpoint as ckpt
from hps_service.trainer.export import config_from_dict, config_to_dict
from hps_service.trainer.journal import PublishJournal
from hps_service.trainer.sharding import AllToAllExchange

if TYPE_CHECKING:
    from pathlib import Path

    from hps_service.trainer.train import Trainer


def save(trainer: Trainer) -> Path | None:
    """Write a checkpoint of the trainer's current step (all ranks together); returns its path."""
    directory = trainer.config.checkpoint_dir
    if directory is None:
        return None
    staging = ckpt.staging_dir(directory, trainer.step)
    if trainer.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        staging.mkdir(exist_ok=True)
    trainer.barrier()
    sink = trainer.sink
    ckpt.write_tables(staging, trainer.rank, trainer.model.tables,
                      sink.unacknowledged if sink is not None else None)
    trainer.barrier()
    path = directory / ckpt.checkpoint_name(trainer.step)
    if trainer.rank == 0:
        ckpt.write_dense(staging, {
            "tower": trainer.model.tower.state_dict(), "adam": trainer.dense_opt.state_dict(),
            "schedule": trainer.dense_schedule.state_dict(), "scaler": trainer.scaler.state_dict(),
        }, {
            "step": trainer.step, "generation": trainer.generation, "position": trainer.position,
            "world_size": trainer.world, "model": trainer.model_name,
            "tables": {t.name: t.dim for t in trainer.model.config.tables}, "data": trainer.data.describe(),
            "last_version": trainer.last_version, "dlrm": config_to_dict(trainer.model.config),
        })
        ckpt.publish_checkpoint(directory, trainer.step, trainer.config.keep_checkpoints)
    trainer.barrier()
    if trainer.journal is not None:
        trainer.journal.rotate()  # every record so far is of a step this checkpoint covers
    trainer.data.commit(trainer.position)
    trainer.checkpoints.append(str(path))
    return path


def _shape_difference(saved: dict, current: dict) -> str:
    keys = sorted(set(saved) | set(current))
    return "; ".join(f"{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}" for k in keys
                     if saved.get(k) != current.get(k))


def restore(trainer: Trainer) -> bool:
    """Load the newest checkpoint when resuming; refuse to start over a directory that has one otherwise."""
    directory = trainer.config.checkpoint_dir
    if directory is None:
        return False
    latest = ckpt.latest_checkpoint(directory)
    if latest is None:
        return False
    meta = ckpt.read_meta(latest)
    if not trainer.config.resume:
        raise FailedPreconditionError(
            f"{directory} holds a checkpoint at step {meta['step']} (generation {meta['generation']}): pass "
            f"--resume to continue it, or use another --checkpoint-dir"
        )
    dims = {t.name: t.dim for t in trainer.model.config.tables}
    if meta["tables"] != dims:
        raise FailedPreconditionError(f"checkpoint {latest} has tables {meta['tables']}, the model {dims}")
    shape = json.loads(json.dumps(config_to_dict(trainer.model.config)))  # as meta.json holds it
    # read through the config so that options newer than the checkpoint take their defaults
    saved = json.loads(json.dumps(config_to_dict(config_from_dict(meta["dlrm"])))) if "dlrm" in meta else shape
    if saved != shape:
        raise FailedPreconditionError(f"checkpoint {latest} was trained with another model shape ("
                                      f"{_shape_difference(saved, shape)}): resume with the same options")
    dense = ckpt.read_dense(latest)
    try:
        trainer.model.tower.load_state_dict(dense["tower"])
    except RuntimeError as exc:
        raise FailedPreconditionError(f"checkpoint {latest} does not fit this model: {exc}") from None
    trainer.dense_opt.load_state_dict(dense["adam"])
    trainer.dense_schedule.load_state_dict(dense["schedule"])
    trainer.scaler.load_state_dict(dense["scaler"])
    owns = None
    if isinstance(trainer.exchange, AllToAllExchange):
        exchange = trainer.exchange
        owns = lambda keys: exchange.owner(keys) == exchange.rank  # noqa: E731
    ckpt.load_tables(latest, trainer.model.tables, owns)
    trainer.step, trainer.position = int(meta["step"]), meta["position"]
    # The interrupted run may have published versions past this step: the next generation outranks them all.
    trainer.generation = max(trainer.config.generation, int(meta["generation"]) + 1)
    if trainer.generation >= 2**31:
        raise FailedPreconditionError("generation would pass 2^31")
    later: dict[str, list[np.ndarray]] = {}
    for rank_dir in sorted(directory.glob("rank*")):  # any rank's records: the owner of a key may have changed
        for name, keys in PublishJournal.keys_after(rank_dir, trainer.step).items():
            later.setdefault(name, []).append(keys)
    for name, table in trainer.model.tables.items():
        keys = np.concatenate(later.get(name, [np.zeros(0, dtype=np.int64)]))
        if owns is not None and keys.size:
            keys = keys[owns(keys)]
        table.mark_changed(keys)
        trainer.republished_on_resume += table.pending()
    trainer.resumed_from = str(latest)
    return True
