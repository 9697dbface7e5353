"""The online training loop: DLRM on a data source, publishing the rows it changes to the server.

Row-wise Adagrad (or SGD) updates the embedding tables, Adam the dense tower (under autocast for bf16/fp16, with
dynamic loss scaling for fp16; embeddings and optimizer state stay fp32). Every ``publish_every_steps`` steps or
``publish_every_s`` seconds the changed rows are published with version ``(generation << 32) | step``, evicted rows
as deletes. Checkpoints and dense-tower exports are written on schedule and at the end; ``--resume`` continues from
the newest checkpoint with the next generation, so no version goes backwards. Under ``torchrun`` the dense tower is
trained with DDP and each embedding row lives on the rank that owns its key (``sharding.AllToAllExchange``); each
rank publishes only its rows. The run ends with a metrics dict (also written as JSON).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hps_service.errors import FailedPreconditionError, InvalidArgumentError
from hps_service.trainer import checkpoint as ckpt
from hps_service.trainer.data import Batch
from hps_service.trainer.export import export_tower
from hps_service.trainer.metrics import auc, log_loss
from hps_service.trainer.model import DLRM, DenseTower, pool, predict_from_rows
from hps_service.trainer.moe import RoutingResult
from hps_service.trainer.sharding import AllToAllExchange, Exchange, LocalExchange
from hps_service.trainer.sources import DataSource, shard_rows
from hps_service.updates.message import make_version
from hps_service.updates.topics import DEFAULT_PARTITIONS

__all__ = ["RowPublisher", "TrainConfig", "Trainer", "make_version", "predict_from_rows", "resolve_device"]

Precision = Literal["fp32", "bf16", "fp16"]
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Dense peak TFLOP/s (no sparsity) by device name fragment, for model FLOPs utilisation: (tf32/fp32, bf16/fp16).
PEAK_TFLOPS = {
    "H200": (494.0, 989.0), "H100": (494.0, 989.0), "GH200": (494.0, 989.0), "B200": (1100.0, 2250.0),
    "A100": (156.0, 312.0), "L40S": (183.0, 362.0), "L4": (60.0, 121.0), "A10": (62.5, 125.0),
    "V100": (15.7, 125.0), "T4": (8.1, 65.0),
}


class RowPublisher(Protocol):
    """What the trainer needs of a publisher: ``hps_service.updates.Publisher`` or ``LatestRowStore``."""

    def publish(self, table: str, keys: np.ndarray, rows: np.ndarray, version: int | np.ndarray) -> int: ...

    def delete(self, table: str, keys: np.ndarray, version: int | np.ndarray) -> int: ...

    def flush(self) -> None: ...


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidArgumentError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FailedPreconditionError("--device cuda, but torch sees no CUDA device")
    return torch.device(device)


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of one training run. ``batch_size`` is the global batch (split over data-parallel ranks)."""

    steps: int | None = None
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
    progress: bool = False
    recovery_tolerance: float = 0.01
    device: str = "cpu"
    precision: Precision = "fp32"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    resume: bool = False
    export_dir: str | None = None
    export_every: int | None = None
    throughput_window: int = 50

    def __post_init__(self) -> None:
        if self.steps is not None and not 1 <= self.steps < 2**32:
            raise InvalidArgumentError(f"steps must be in [1, 2^32), got {self.steps}")
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
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise InvalidArgumentError(f"--precision must be fp32, bf16 or fp16, not {self.precision!r}")
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1 or self.throughput_window < 1:
            raise InvalidArgumentError("checkpoint_every, keep_checkpoints and throughput_window must be >= 1")
        if self.export_every is not None and self.export_every < 1:
            raise InvalidArgumentError("export_every must be >= 1")
        if self.resume and self.checkpoint_dir is None:
            raise InvalidArgumentError("--resume needs --checkpoint-dir")


@dataclass
class EvalPoint:
    """Held-out quality at one step, next to the oracle's on the same samples where the data has one."""

    step: int
    elapsed_s: float
    auc: float
    log_loss: float
    oracle_auc: float | None
    oracle_log_loss: float | None
    expert_load: list[float] | None = None  # share of routed tokens per expert since the previous point


class LossScaler:
    """Dynamic loss scaling for fp16: halve and skip the step on inf/NaN gradients, double after a clean stretch."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale /= 2.0
            self._good = 0
            self.skipped += 1
        else:
            self._good += 1
            if self._good % self.growth_interval == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good": float(self._good), "skipped": float(self.skipped)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self._good, self.skipped = float(state["scale"]), int(state["good"]), int(state["skipped"])


class Trainer:
    """Trains ``model`` on ``data`` and, when a publisher is given, streams the changed rows to it."""

    def __init__(
        self, model: DLRM, data: DataSource, config: TrainConfig, publisher: RowPublisher | None = None,
        model_name: str = "model", partitions: int | None = None,
    ) -> None:
        """``partitions``: of the update topic (``cluster.partitions``); with several ranks a key's row lives on rank
        ``partition_of(key, partitions) % world``. Default: the publisher's topic's, else the config default."""
        if model.config.num_dense != data.num_dense:
            raise InvalidArgumentError(
                f"model expects {model.config.num_dense} dense features, data has {data.num_dense}"
            )
        self.model = model
        self.data = data
        self.config = config
        self.publisher = publisher
        self.model_name = model_name
        self.device = resolve_device(config.device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if config.batch_size % self.world:
            raise InvalidArgumentError(f"batch_size {config.batch_size} must be a multiple of the {self.world} ranks")
        for table in model.tables.values():
            table.optimizer, table.lr = config.embedding_optimizer, config.embedding_lr
        partitions = partitions or getattr(publisher, "partitions", None) or DEFAULT_PARTITIONS
        self.exchange: Exchange = (
            AllToAllExchange(model.tables, partitions) if self.distributed else LocalExchange(model.tables)
        )
        model.tower.to(self.device)
        self.tower: torch.nn.Module = model.tower
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.tower = DistributedDataParallel(
                model.tower, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                forward_sync_buffers=False,
            )
        self.dense_opt = torch.optim.Adam(model.tower.parameters(), lr=config.dense_lr)
        self._schedule_steps = config.steps or data.total_steps(config.batch_size, 0)
        final = config.dense_lr_final_fraction
        total = self._schedule_steps
        self.dense_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.dense_opt, lambda step: 1.0 - (1.0 - final) * min(step / total, 1.0) if total else 1.0
        )
        self.scaler = LossScaler(config.precision == "fp16")
        self.generation = config.generation
        self.step = 0
        self.position = 0
        self.history: list[EvalPoint] = []
        self.rows_published = 0
        self.rows_deleted = 0
        self.publishes = 0
        self.last_version: int | None = None
        self.exports: list[str] = []
        self._exported_step: int | None = None
        self.checkpoints: list[str] = []
        self.resumed_from: str | None = None
        self._moe_load: torch.Tensor | None = None
        self._moe_load_since_eval: torch.Tensor | None = None
        self._moe_dropped: list[float] = []
        self._moe_aux: list[float] = []
        self._moe_z: list[float] = []
        self._routed_pairs = 0  # (token, expert) pairs the experts computed in the last step
        self._window: deque[tuple[float, int, float]] = deque(maxlen=config.throughput_window)
        self._train_s = 0.0
        self._data_s = 0.0
        self._cpu_s = 0.0
        self._samples = 0
        self._flops = 0.0

    # ---- one step -----------------------------------------------------------------------------------------
    def _lookup(self, batch: Batch, train: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Distinct keys' rows and each id's index into them, per table."""
        uniques, inverses = {}, {}
        for name in self.model.config.table_names:
            if name not in batch.sparse:
                raise InvalidArgumentError(f"batch has no ids for table {name!r}")
            uniques[name], inverses[name] = np.unique(batch.sparse[name].ravel(), return_inverse=True)
        rows = self.exchange.fetch(uniques, self.step, train)
        return rows, inverses

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def train_step(self, batch: Batch) -> float:
        """Forward, backward, both optimizers, expert-bias update. Returns the BCE loss of the local batch."""
        cfg = self.config
        self.tower.train()
        rows, inverses = self._lookup(batch, train=True)
        leaves = {name: self._to_device(r).requires_grad_() for name, r in rows.items()}
        pooled = {name: pool(leaves[name], self._to_device(inverses[name].astype(np.int64)), len(batch))
                  for name in leaves}
        dense = self._to_device(batch.dense)
        labels = self._to_device(batch.labels)
        with torch.autocast(self.device.type, dtype=_AUTOCAST.get(cfg.precision), enabled=cfg.precision != "fp32"):
            out = self.tower(dense, pooled)
        bce = F.binary_cross_entropy_with_logits(out.logits.float(), labels)
        loss = bce
        if out.routing is not None:
            loss = loss + out.routing.aux_loss + out.routing.z_loss
            self._record_moe(out.routing)
        self.dense_opt.zero_grad(set_to_none=True)
        (loss * self.scaler.scale).backward()
        # row gradients go back to the tables in host memory
        grads = {name: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).to("cpu", torch.float32)
                 for name, leaf in leaves.items()}
        if self.scaler.enabled:
            inv = 1.0 / self.scaler.scale
            for p in self.model.tower.parameters():
                if p.grad is not None:
                    p.grad.mul_(inv)
            grads = {name: g * inv for name, g in grads.items()}
            bad = not all(bool(torch.isfinite(g).all()) for g in grads.values()) or not all(
                bool(torch.isfinite(p.grad).all()) for p in self.model.tower.parameters() if p.grad is not None)
            found = torch.tensor([1.0 if bad else 0.0])
            if self.distributed:
                found = self._all_reduce(found, dist.ReduceOp.MAX)
            self.scaler.update(bool(found.item()))
            if found.item():
                grads = {name: torch.zeros_like(g) for name, g in grads.items()}
                self.exchange.push(grads)  # the owners expect this round; zero gradients change no row
                self.dense_opt.zero_grad(set_to_none=True)
                return float(bce.detach())
        self.exchange.push(grads)
        self.dense_opt.step()
        self.dense_schedule.step()
        if self.model.tower.moe is not None:
            self.model.tower.moe.router.update_expert_bias(
                (lambda t: dist.all_reduce(t)) if self.distributed else None
            )
        return float(bce.detach())

    def _record_moe(self, routing: RoutingResult) -> None:
        load = routing.tokens_per_expert.detach().to("cpu", torch.float64)
        self._moe_load = load if self._moe_load is None else self._moe_load + load
        self._moe_load_since_eval = load if self._moe_load_since_eval is None else self._moe_load_since_eval + load
        self._moe_dropped.append(float(routing.dropped_fraction))
        self._moe_aux.append(float(routing.aux_loss.detach()))
        self._moe_z.append(float(routing.z_loss.detach()))
        self._routed_pairs = routing.routed_pairs

    def _step_flops(self, samples: int) -> float:
        """Model FLOPs of one training step on this rank: 3x forward, with the experts' routed (kept) pairs."""
        tower = self.model.tower
        flops = samples * tower.dense_flops_per_sample()
        if tower.moe is not None:
            flops += self._routed_pairs * tower.moe.expert_flops_per_pair()
        return 3.0 * flops

    # ---- publishing ---------------------------------------------------------------------------------------
    def publish_changes(self) -> int:
        """Publish this rank's rows changed since the last publish, and deletes of evicted rows; returns rows sent."""
        if self.publisher is None:
            return 0
        version = make_version(self.generation, self.step)
        sent = 0
        for name, table in self.model.tables.items():
            deletes, keys, rows = table.take_changes()
            if deletes.size:
                self.publisher.delete(name, deletes, version)
                self.rows_deleted += int(deletes.size)
            if keys.size:
                self.publisher.publish(name, keys, rows, version)
                sent += int(keys.size)
        self.publisher.flush()
        self.rows_published += sent
        self.publishes += 1
        self.last_version = version
        return sent

    # ---- evaluation ---------------------------------------------------------------------------------------
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities (fp32, eval mode) with rows as the server serves them (all ranks call together)."""
        rows, inverses = self._lookup(batch, train=False)
        return predict_from_rows(self.model.tower, {n: rows[n][inverses[n]] for n in rows}, batch)

    def evaluate(self, elapsed_s: float) -> EvalPoint:
        """Held-out AUC and log-loss (and the oracle's, where known); appended to ``history``."""
        holdout = self.data.holdout(self.config.holdout_size, self.step)
        local = holdout.rows(shard_rows(len(holdout), self.rank, self.world))
        prob = self.predict(local)
        if self.distributed:
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, prob)
            prob = np.concatenate(parts)
        load = None
        if self._moe_load_since_eval is not None:
            total = self._moe_load_since_eval
            if self.distributed:
                total = self._all_reduce(total)
            load = (total / total.sum().clamp(min=1)).tolist()
            self._moe_load_since_eval = None
        point = EvalPoint(
            step=self.step, elapsed_s=elapsed_s, auc=auc(prob, holdout.labels), log_loss=log_loss(prob, holdout.labels),
            oracle_auc=auc(holdout.prob, holdout.labels) if holdout.prob is not None else None,
            oracle_log_loss=log_loss(holdout.prob, holdout.labels) if holdout.prob is not None else None,
            expert_load=load,
        )
        self.history.append(point)
        return point

    # ---- checkpoints and exports ----------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or ``op``) over the ranks; through the GPU when the group is nccl, which takes no host tensors."""
        on = tensor.to(self.device) if dist.get_backend() == "nccl" else tensor
        dist.all_reduce(on, op=op)
        return on.to(tensor.device)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (all ranks together); returns its path."""
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        staging = ckpt.staging_dir(directory, self.step)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            staging.mkdir(exist_ok=True)
        self._barrier()
        ckpt.write_tables(staging, self.rank, self.model.tables)
        self._barrier()
        path = directory / ckpt.checkpoint_name(self.step)
        if self.rank == 0:
            ckpt.write_dense(staging, {
                "tower": self.model.tower.state_dict(), "adam": self.dense_opt.state_dict(),
                "schedule": self.dense_schedule.state_dict(), "scaler": self.scaler.state_dict(),
            }, {
                "step": self.step, "generation": self.generation, "position": self.position,
                "world_size": self.world, "model": self.model_name,
                "tables": {t.name: t.dim for t in self.model.config.tables}, "data": self.data.describe(),
                "last_version": self.last_version,
            })
            ckpt.publish_checkpoint(directory, self.step, self.config.keep_checkpoints)
        self._barrier()
        self.checkpoints.append(str(path))
        return path

    def restore(self) -> bool:
        """Load the newest checkpoint when resuming; refuse to start over a directory that has one otherwise."""
        directory = self.config.checkpoint_dir
        latest = ckpt.latest_checkpoint(directory) if directory is not None else None
        if latest is None:
            return False
        meta = ckpt.read_meta(latest)
        if not self.config.resume:
            raise FailedPreconditionError(
                f"{directory} holds a checkpoint at step {meta['step']} (generation {meta['generation']}): pass "
                f"--resume to continue it, or use another --checkpoint-dir"
            )
        dims = {t.name: t.dim for t in self.model.config.tables}
        if meta["tables"] != dims:
            raise FailedPreconditionError(f"checkpoint {latest} has tables {meta['tables']}, the model {dims}")
        dense = ckpt.read_dense(latest)
        self.model.tower.load_state_dict(dense["tower"])
        self.dense_opt.load_state_dict(dense["adam"])
        self.dense_schedule.load_state_dict(dense["schedule"])
        self.scaler.load_state_dict(dense["scaler"])
        owns = None
        if isinstance(self.exchange, AllToAllExchange):
            exchange = self.exchange
            owns = lambda keys: exchange.owner(keys) == exchange.rank  # noqa: E731
        ckpt.load_tables(latest, self.model.tables, owns)
        self.step, self.position = int(meta["step"]), int(meta["position"])
        # The crashed run may have published versions past this step: the next generation outranks them all.
        self.generation = max(self.config.generation, int(meta["generation"]) + 1)
        if self.generation >= 2**31:
            raise FailedPreconditionError("generation would pass 2^31")
        for table in self.model.tables.values():
            table.mark_all_changed()  # the server may hold rows of the lost steps: republish what we hold
        self.resumed_from = str(latest)
        return True

    def export(self) -> str | None:
        """Write the dense tower as an artifact of the current version (rank 0; after this step's publish)."""
        if self.config.export_dir is None:
            return None
        path = None
        if self.rank == 0:
            path = export_tower(
                self.config.export_dir, self.model.tower, self.model_name, make_version(self.generation, self.step),
                self.step, {"data": self.data.describe(), "default": "hashed_random"},
            )
            self.exports.append(path)
        self._exported_step = self.step
        self._barrier()
        return path

    # ---- the run ------------------------------------------------------------------------------------------
    def run(self, metrics_path: Path | None = None) -> dict[str, Any]:
        """Train until ``config.steps`` (or the data ends), publishing, evaluating, checkpointing and exporting."""
        cfg = self.config
        self.restore()
        drift = self.data.drift
        start = time.perf_counter()
        last_publish_t = start
        steps_since_publish = 0
        loss_ema: float | None = None
        last = None
        target = cfg.steps or self._schedule_steps
        progress = self._progress() if cfg.progress and self.rank == 0 else None
        task = progress.add_task("train", total=target, stats="", completed=self.step) if progress else None
        if progress is not None:
            progress.start()
        try:
            t_ready, cpu_ready = time.perf_counter(), time.process_time()
            for batch, position, global_size in self.data.batches(cfg.batch_size, self.position, self.rank,
                                                                  self.world):
                data_s = time.perf_counter() - t_ready  # reading and encoding this rank's rows
                if cfg.steps is not None and self.step >= cfg.steps:
                    break
                if self.world > 1 and global_size < cfg.batch_size:
                    break  # ranks need equal shards: the last short batch of a pass is left out
                if drift is not None and self.step == drift.step and (not self.history or
                                                                      self.history[-1].step != self.step):
                    self.evaluate(time.perf_counter() - start)
                t0 = time.perf_counter()
                loss = self.train_step(batch)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t0
                self._cpu_s += time.process_time() - cpu_ready
                flops = self._step_flops(len(batch))
                self._window.append((data_s + dt, global_size, flops))
                self._train_s += dt
                self._data_s += data_s
                self._samples += global_size
                self._flops += flops
                self.step += 1
                self.position = position
                loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
                steps_since_publish += 1
                if self.publisher is not None and (
                    steps_since_publish >= cfg.publish_every_steps
                    or time.perf_counter() - last_publish_t >= cfg.publish_every_s
                ):
                    self.publish_changes()
                    steps_since_publish = 0
                    last_publish_t = time.perf_counter()
                if self.step % cfg.eval_every == 0:
                    last = self.evaluate(time.perf_counter() - start)
                if cfg.export_every is not None and self.step % cfg.export_every == 0:
                    if self.publisher is not None and steps_since_publish:
                        self.publish_changes()
                        steps_since_publish = 0
                    self.export()
                if cfg.checkpoint_dir is not None and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                if progress is not None and task is not None:
                    auc_text = f"{last.auc:.4f}" if last is not None else "-"
                    progress.update(task, completed=self.step, stats=f"{self.samples_per_s():,.0f} samples/s  "
                                    f"loss {loss_ema:.4f}  AUC {auc_text}")
                t_ready, cpu_ready = time.perf_counter(), time.process_time()
            if self.publisher is not None:
                self.publish_changes()
            if not self.history or self.history[-1].step != self.step:
                self.evaluate(time.perf_counter() - start)
            if cfg.export_dir is not None and self._exported_step != self.step:
                self.export()
            if cfg.checkpoint_dir is not None:
                self.save_checkpoint()
        finally:
            if progress is not None:
                progress.stop()
        wall_s = time.perf_counter() - start
        metrics = self._metrics(wall_s)
        if metrics_path is not None and self.rank == 0:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text(json.dumps(metrics, indent=2))
        return metrics

    def samples_per_s(self) -> float:
        """Global samples/s over the last ``throughput_window`` steps: reading the data and the training step
        (publishing, evaluations, checkpoints and exports not included)."""
        seconds = sum(w[0] for w in self._window)
        return sum(w[1] for w in self._window) / seconds if seconds > 0 else 0.0

    @staticmethod
    def _progress() -> Progress:
        return Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
        )

    def _peak_flops(self) -> float | None:
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        for fragment, (fp32, half) in PEAK_TFLOPS.items():
            if fragment in name:
                return (fp32 if self.config.precision == "fp32" else half) * 1e12
        return None

    def _metrics(self, wall_s: float) -> dict[str, Any]:
        window_s = sum(w[0] for w in self._window)
        window_flops = sum(w[2] for w in self._window)
        totals = torch.tensor([window_flops, self._flops, self._cpu_s], dtype=torch.float64)
        if self.distributed:
            totals = self._all_reduce(totals)
        flops_per_s = float(totals[0]) / window_s if window_s > 0 else 0.0
        peak = self._peak_flops()
        final = self.history[-1]
        tower: DenseTower = self.model.tower
        return {
            "steps": self.step,
            "batch_size": self.config.batch_size,
            "world_size": self.world,
            "device": str(self.device),
            "precision": self.config.precision,
            "samples": self._samples,
            "wall_s": wall_s,
            "train_s": self._train_s,
            "samples_per_s": self.samples_per_s(),
            "samples_per_s_whole_run": self._samples / (self._train_s + self._data_s) if self._train_s > 0 else 0.0,
            "data_s": self._data_s,
            # CPU seconds all ranks spent reading data and in training steps: samples per CPU second is what
            # the wall-clock samples/s would be per core on otherwise idle cores
            "train_cpu_s": float(totals[2]),
            "samples_per_cpu_s": self._samples / float(totals[2]) if totals[2] > 0 else 0.0,
            "throughput_window_steps": len(self._window),
            "model_flops_per_sample_nominal": 3 * tower.flops_per_sample(),
            "model_flops_per_s": flops_per_s,
            "model_flops_total": float(totals[1]),
            "mfu": flops_per_s / (peak * self.world) if peak else None,
            "final": {
                "auc": final.auc,
                "log_loss": final.log_loss,
                "oracle_auc": final.oracle_auc,
                "oracle_log_loss": final.oracle_log_loss,
                "auc_gap": final.oracle_auc - final.auc if final.oracle_auc is not None else None,
                "log_loss_gap": final.log_loss - final.oracle_log_loss if final.oracle_log_loss is not None else None,
            },
            "history": [asdict(p) for p in self.history],
            "moe": self._moe_metrics(),
            "tables": {name: {"rows": t.rows, "evictions": t.evictions} for name, t in self.model.tables.items()},
            "publishing": {
                "enabled": self.publisher is not None,
                "rows_published": self.rows_published,
                "rows_deleted": self.rows_deleted,
                "publishes": self.publishes,
                "rows_published_per_s": self.rows_published / max(wall_s, 1e-9),
                "last_version": self.last_version,
                "generation": self.generation,
            },
            "fp16_skipped_steps": self.scaler.skipped,
            "checkpoints": self.checkpoints,
            "resumed_from": self.resumed_from,
            "exports": self.exports,
            "drift": self._drift_metrics(),
        }

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
            "load_over_time": [{"step": p.step, "load": p.expert_load} for p in self.history if p.expert_load],
            "dropped_fraction": float(np.mean(self._moe_dropped)),
            "aux_loss": float(np.mean(self._moe_aux[-100:])),
            "z_loss": float(np.mean(self._moe_z[-100:])),
            "expert_bias": bias.tolist() if bias is not None else None,
        }

    def _drift_metrics(self) -> dict[str, Any] | None:
        drift = self.data.drift
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
