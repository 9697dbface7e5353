"""The online training loop: DLRM on planted-teacher batches, publishing the rows it changes to the server.

Row-wise Adagrad (or SGD) updates the embedding tables, Adam the dense tower. Every step's touched rows are
recorded; every ``publish_every_steps`` steps or ``publish_every_s`` seconds their full current values are published
with version ``(generation << 32) | step``. The run ends with a metrics dict (also written as JSON): held-out AUC and
log-loss against the teacher's oracle, samples/s, model FLOPs/s, MoE health, rows published/s, drift recovery.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import Batch, PlantedTeacherData
from hps_service.trainer.metrics import auc, log_loss
from hps_service.trainer.model import DLRM, predict_from_rows
from hps_service.trainer.moe import RoutingResult
from hps_service.trainer.optim import SparseRowOptimizer, TouchedRows
from hps_service.updates.message import make_version

__all__ = ["RowPublisher", "TrainConfig", "Trainer", "make_version", "predict_from_rows"]

class RowPublisher(Protocol):
    """What the trainer needs of a publisher: ``hps_service.updates.Publisher`` or ``LatestRowStore``."""

    def publish(self, table: str, keys: np.ndarray, rows: np.ndarray, version: int | np.ndarray) -> int: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of one training run."""

    steps: int
    batch_size: int = 512
    embedding_optimizer: Literal["adagrad", "sgd"] = "adagrad"
    embedding_lr: float = 0.2
    dense_lr: float = 1e-2
    dense_lr_final_fraction: float = 0.1
    publish_every_steps: int = 50
    publish_every_s: float = 1.0
    eval_every: int = 100
    holdout_size: int = 20_000
    generation: int = 0
    publish_initial: bool = True
    progress: bool = False
    recovery_tolerance: float = 0.01

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InvalidArgumentError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.dense_lr <= 0 or self.embedding_lr <= 0:
            raise InvalidArgumentError("learning rates must be > 0")
        if not 0 < self.dense_lr_final_fraction <= 1:
            raise InvalidArgumentError("dense_lr_final_fraction must be in (0, 1]")
        if self.publish_every_steps < 1 or self.publish_every_s <= 0:
            raise InvalidArgumentError("publish_every_steps must be >= 1 and publish_every_s > 0")
        if self.eval_every < 1 or self.holdout_size < 2:
            raise InvalidArgumentError("eval_every must be >= 1 and holdout_size >= 2")
        if not 0 <= self.generation < 2**31:
            raise InvalidArgumentError(f"generation must be in [0, 2^31), got {self.generation}")
        if self.steps >= 2**32:
            raise InvalidArgumentError("steps must fit the 32 low bits of a row version")


@dataclass
class EvalPoint:
    """Held-out quality at one step, next to the oracle on the same samples."""

    step: int
    elapsed_s: float
    auc: float
    log_loss: float
    oracle_auc: float
    oracle_log_loss: float


class Trainer:
    """Trains ``model`` on ``data`` and, when a publisher is given, streams the changed rows to it."""

    def __init__(
        self, model: DLRM, data: PlantedTeacherData, config: TrainConfig, publisher: RowPublisher | None = None
    ) -> None:
        fields = set(data.config.fields)
        for spec in model.config.tables:
            if spec.name not in fields:
                raise InvalidArgumentError(f"model table {spec.name!r} is not a data field ({sorted(fields)})")
            card = data.config.cardinalities[data.config.fields.index(spec.name)]
            if spec.cardinality < card:
                raise InvalidArgumentError(
                    f"table {spec.name!r} holds {spec.cardinality} rows but the data draws ids up to {card}"
                )
        if model.config.num_dense != data.config.num_dense:
            raise InvalidArgumentError(
                f"model expects {model.config.num_dense} dense features, data has {data.config.num_dense}"
            )
        self.model = model
        self.data = data
        self.config = config
        self.publisher = publisher
        self.sparse_opt = SparseRowOptimizer(
            {name: model.embeddings[name] for name in model.config.table_names},
            lr=config.embedding_lr,
            kind=config.embedding_optimizer,
        )
        self.dense_opt = torch.optim.Adam(model.tower.parameters(), lr=config.dense_lr)
        final = config.dense_lr_final_fraction
        self.dense_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.dense_opt, lambda step: 1.0 - (1.0 - final) * min(step / config.steps, 1.0)
        )
        self.touched = TouchedRows({t.name: t.cardinality for t in model.config.tables})
        self.history: list[EvalPoint] = []
        self.rows_published = 0
        self.publishes = 0
        self.last_version: int | None = None
        self._holdouts: dict[bool, Batch] = {}
        self._moe_load: torch.Tensor | None = None
        self._moe_dropped: list[float] = []
        self._moe_aux: list[float] = []
        self._moe_z: list[float] = []

    # ---- one step -----------------------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> float:
        """Forward, backward, both optimizers, expert-bias update; marks touched rows. Returns the BCE loss."""
        self.model.train()
        out = self.model(batch)
        bce = F.binary_cross_entropy_with_logits(out.logits, torch.from_numpy(batch.labels))
        loss = bce
        if out.routing is not None:
            loss = loss + out.routing.aux_loss + out.routing.z_loss
            self._record_moe(out.routing)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.dense_opt.step()
        self.dense_schedule.step()
        for table, rows in self.sparse_opt.step().items():
            self.touched.mark(table, rows)
        if self.model.tower.moe is not None:
            self.model.tower.moe.router.update_expert_bias()
        return float(bce.detach())

    def _record_moe(self, routing: RoutingResult) -> None:
        load = routing.tokens_per_expert.detach().to(torch.float64)
        self._moe_load = load if self._moe_load is None else self._moe_load + load
        self._moe_dropped.append(float(routing.dropped_fraction))
        self._moe_aux.append(float(routing.aux_loss.detach()))
        self._moe_z.append(float(routing.z_loss.detach()))

    # ---- publishing ---------------------------------------------------------------------------------------
    def publish_touched(self, step: int) -> int:
        """Publish the current values of every row touched since the last publish; returns rows published."""
        if self.publisher is None:
            return 0
        version = make_version(self.config.generation, step)
        sent = 0
        for table, keys in self.touched.take().items():
            self.publisher.publish(table, keys, self.model.table_rows(table, keys), version)
            sent += int(keys.size)
        self.publisher.flush()
        self.rows_published += sent
        self.publishes += 1
        self.last_version = version
        return sent

    def publish_all(self, step: int, chunk_rows: int = 65536) -> int:
        """Publish every row of every table (the starting point, so ids never trained still serve the model's rows)."""
        if self.publisher is None:
            return 0
        version = make_version(self.config.generation, step)
        sent = 0
        for spec in self.model.config.tables:
            for start in range(0, spec.cardinality, chunk_rows):
                keys = np.arange(start, min(start + chunk_rows, spec.cardinality), dtype=np.int64)
                self.publisher.publish(spec.name, keys, self.model.table_rows(spec.name, keys), version)
                sent += int(keys.size)
        self.publisher.flush()
        self.rows_published += sent
        self.publishes += 1
        self.last_version = version
        return sent

    # ---- evaluation ---------------------------------------------------------------------------------------
    def _after_drift(self, step: int) -> bool:
        drift = self.data.config.drift
        return drift is not None and step >= drift.step

    def holdout(self, step: int) -> Batch:
        """The held-out set labelled by the teacher in force at ``step`` (cached per drift phase)."""
        phase = self._after_drift(step)
        if phase not in self._holdouts:
            self._holdouts[phase] = self.data.holdout(self.config.holdout_size, at_step=step)
        return self._holdouts[phase]

    def evaluate(self, step: int, elapsed_s: float) -> EvalPoint:
        """Held-out AUC and log-loss of the model and of the oracle; appended to ``history``."""
        batch = self.holdout(step)
        prob = self.model.predict(batch)
        point = EvalPoint(
            step=step,
            elapsed_s=elapsed_s,
            auc=auc(prob, batch.labels),
            log_loss=log_loss(prob, batch.labels),
            oracle_auc=auc(batch.prob, batch.labels),
            oracle_log_loss=log_loss(batch.prob, batch.labels),
        )
        self.history.append(point)
        return point

    # ---- the run ------------------------------------------------------------------------------------------
    def run(self, metrics_path: Path | None = None) -> dict[str, Any]:
        """Train ``config.steps`` steps, publishing and evaluating on schedule; returns (and writes) the metrics."""
        cfg = self.config
        drift = self.data.config.drift
        start = time.perf_counter()
        train_s = 0.0
        last_publish_t = start
        steps_since_publish = 0
        loss_ema: float | None = None
        last = None
        progress = self._progress() if cfg.progress else None
        task = progress.add_task("train", total=cfg.steps, stats="") if progress is not None else None
        if progress is not None:
            progress.start()
        try:
            if cfg.publish_initial:
                self.publish_all(0)
            for step in range(cfg.steps):
                if drift is not None and step == drift.step and (not self.history or self.history[-1].step != step):
                    self.evaluate(step, time.perf_counter() - start)
                batch = self.data.batch(step, cfg.batch_size)
                t0 = time.perf_counter()
                loss = self.train_step(batch)
                train_s += time.perf_counter() - t0
                loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
                done = step + 1
                steps_since_publish += 1
                now = time.perf_counter()
                if self.publisher is not None and (
                    steps_since_publish >= cfg.publish_every_steps or now - last_publish_t >= cfg.publish_every_s
                ):
                    self.publish_touched(done)
                    steps_since_publish = 0
                    last_publish_t = time.perf_counter()
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    last = self.evaluate(done, time.perf_counter() - start)
                if progress is not None and task is not None:
                    rate = done * cfg.batch_size / max(train_s, 1e-9)
                    auc_text = f"{last.auc:.4f}" if last is not None else "-"
                    progress.update(task, completed=done,
                                    stats=f"{rate:,.0f} samples/s  loss {loss_ema:.4f}  AUC {auc_text}")
            if self.publisher is not None and self.touched.pending():
                self.publish_touched(cfg.steps)
        finally:
            if progress is not None:
                progress.stop()
        wall_s = time.perf_counter() - start
        metrics = self._metrics(wall_s, train_s)
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text(json.dumps(metrics, indent=2))
        return metrics

    @staticmethod
    def _progress() -> Progress:
        return Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
        )

    def _metrics(self, wall_s: float, train_s: float) -> dict[str, Any]:
        cfg = self.config
        samples = cfg.steps * cfg.batch_size
        samples_per_s = samples / max(train_s, 1e-9)
        flops_per_sample = 3 * self.model.tower.flops_per_sample()
        final = self.history[-1]
        metrics: dict[str, Any] = {
            "steps": cfg.steps,
            "batch_size": cfg.batch_size,
            "samples": samples,
            "wall_s": wall_s,
            "train_s": train_s,
            "samples_per_s": samples_per_s,
            "model_flops_per_sample": flops_per_sample,
            "model_flops_per_s": flops_per_sample * samples_per_s,
            "final": {
                "auc": final.auc,
                "log_loss": final.log_loss,
                "oracle_auc": final.oracle_auc,
                "oracle_log_loss": final.oracle_log_loss,
                "auc_gap": final.oracle_auc - final.auc,
                "log_loss_gap": final.log_loss - final.oracle_log_loss,
            },
            "history": [asdict(p) for p in self.history],
            "moe": self._moe_metrics(),
            "publishing": {
                "enabled": self.publisher is not None,
                "rows_published": self.rows_published,
                "publishes": self.publishes,
                "rows_published_per_s": self.rows_published / max(wall_s, 1e-9),
                "last_version": self.last_version,
            },
            "drift": self._drift_metrics(),
        }
        return metrics

    def _moe_metrics(self) -> dict[str, Any] | None:
        moe = self.model.tower.moe
        if moe is None or self._moe_load is None:
            return None
        load = self._moe_load / self._moe_load.sum().clamp(min=1)
        bias = moe.router.expert_bias
        return {
            "num_experts": moe.config.num_experts,
            "top_k": moe.config.top_k,
            "load_per_expert": load.tolist(),
            "max_load_over_mean": float(load.max() * load.numel()),
            "dropped_fraction": float(np.mean(self._moe_dropped)),
            "aux_loss": float(np.mean(self._moe_aux[-100:])),
            "z_loss": float(np.mean(self._moe_z[-100:])),
            "expert_bias": bias.tolist() if bias is not None else None,
        }

    def _drift_metrics(self) -> dict[str, Any] | None:
        drift = self.data.config.drift
        if drift is None:
            return None
        before = [p for p in self.history if p.step < drift.step]
        after = [p for p in self.history if p.step >= drift.step]
        if not before or not after:
            return {"step": drift.step, "field": drift.field, "ids": len(drift.ids), "recovered_at_step": None}
        gap_before = before[-1].oracle_auc - before[-1].auc
        at_drift = after[0]
        recovered = next(
            (p for p in after[1:] if p.oracle_auc - p.auc <= gap_before + self.config.recovery_tolerance), None
        )
        return {
            "step": drift.step,
            "field": drift.field,
            "ids": len(drift.ids),
            "auc_gap_before": gap_before,
            "auc_gap_at_drift": at_drift.oracle_auc - at_drift.auc,
            "recovered_at_step": recovered.step if recovered else None,
            "recovery_steps": recovered.step - drift.step if recovered else None,
            "recovery_s": recovered.elapsed_s - at_drift.elapsed_s if recovered else None,
        }
