"""The online training loop: DLRM on a data source, publishing the rows it changes to the server.

Row-wise Adagrad (or SGD) updates the embedding tables, Adam the dense tower (under autocast for bf16/fp16, with
dynamic loss scaling for fp16; embeddings and optimizer state stay fp32). Every batch is scored before the model
trains on it (progressive validation). Every ``publish_every_steps`` steps or ``publish_every_s`` seconds the
changed rows are handed to a background publisher with version ``(generation << 32) | step``, evicted and expired
rows as deletes. Checkpoints and dense-tower exports are written on schedule and at the end; ``--resume``
continues from the newest checkpoint with the next generation, so no version goes backwards, and republishes only
what the checkpoint's acknowledged publishes did not cover. ``request_stop`` (SIGTERM in ``hps train``) ends the
run after the current step, with a final publish and checkpoint. Under ``torchrun`` the dense tower is trained with
DDP and each embedding row lives on the rank that owns its key (``sharding.AllToAllExchange``); each rank
publishes only its rows. The run ends with a metrics dict (also written as JSON).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hps_service.errors import InvalidArgumentError
from hps_service.trainer import checkpointing
from hps_service.trainer.data import Batch
from hps_service.trainer.export import export_tower
from hps_service.trainer.journal import PublishJournal
from hps_service.trainer.metrics import auc, log_loss
from hps_service.trainer.model import DLRM, pool, predict_from_rows
from hps_service.trainer.moe import RoutingResult
from hps_service.trainer.precision import AUTOCAST, LossScaler, resolve_device
from hps_service.trainer.progressive import ProgressiveMetrics
from hps_service.trainer.publishing import BackgroundPublisher, PublishJob, RowPublisher, TableChanges
from hps_service.trainer.report import progress_bar, run_metrics
from hps_service.trainer.run_config import EvalPoint, TrainConfig
from hps_service.trainer.schedule import dense_lr_factor
from hps_service.trainer.sharding import AllToAllExchange, Exchange, LocalExchange
from hps_service.trainer.sources import DataSource, shard_rows
from hps_service.updates.message import make_version
from hps_service.updates.topics import DEFAULT_PARTITIONS

__all__ = ["RowPublisher", "TrainConfig", "Trainer", "make_version", "predict_from_rows", "resolve_device"]


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
        if self.world > 1 and not data.bounded:
            raise InvalidArgumentError("kafka:// and --follow sources train in one process, not under torchrun")
        for table in model.tables.values():
            table.optimizer, table.lr = config.embedding_optimizer, config.embedding_lr
            table.set_admission(config.admit_after)
        partitions = partitions or getattr(publisher, "partitions", None) or DEFAULT_PARTITIONS
        self.exchange: Exchange = (
            AllToAllExchange(model.tables, partitions) if self.distributed else LocalExchange(model.tables)
        )
        model.tower.to(self.device)
        self.tower: torch.nn.Module = model.tower
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel

            # no buffer broadcast: every rank applies the same expert-bias update (counts summed over ranks)
            self.tower = DistributedDataParallel(
                model.tower, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
            )
        self.dense_opt = torch.optim.Adam(model.tower.parameters(), lr=config.dense_lr)
        self.dense_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.dense_opt, dense_lr_factor(config.warmup_steps, config.steps, config.dense_lr_final_fraction)
        )
        self.scaler = LossScaler(config.precision == "fp16")
        # the training forward scores each batch as serving would unless it drops tokens or runs in low precision
        moe = model.config.moe
        self._exact_training_scores = config.precision == "fp32" and (moe is None or moe.capacity_factor is None)
        self.progressive = ProgressiveMetrics(config.progressive_window)
        self.stop = threading.Event()
        self.sink: BackgroundPublisher | None = None
        self.journal: PublishJournal | None = None
        self.generation = config.generation
        self.step = 0
        self.position: Any = None
        self.history: list[EvalPoint] = []
        self.exports: list[str] = []
        self._exported_step: int | None = None
        self.checkpoints: list[str] = []
        self.resumed_from: str | None = None
        self.republished_on_resume = 0
        self.publish_wait_s = 0.0
        self.moe_load: torch.Tensor | None = None
        self._moe_load_since_eval: torch.Tensor | None = None
        self.moe_dropped: list[float] = []
        self.moe_aux: list[float] = []
        self.moe_z: list[float] = []
        self._routed_pairs = 0  # (token, expert) pairs the experts computed in the last step
        self.window: deque[tuple[float, int, float]] = deque(maxlen=config.throughput_window)
        self.train_s = 0.0
        self.data_s = 0.0
        self.cpu_s = 0.0
        self.samples = 0
        self.flops = 0.0

    def request_stop(self) -> None:
        """End the run after the current step: publish, export, checkpoint and return (safe from a signal handler)."""
        self.stop.set()

    # ---- one step -----------------------------------------------------------------------------------------
    def _lookup(self, batch: Batch, train: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Distinct keys' rows and each id's index into them, per table."""
        uniques, inverses, counts = {}, {}, {}
        for name in self.model.config.table_names:
            if name not in batch.sparse:
                raise InvalidArgumentError(f"batch has no ids for table {name!r}")
            uniques[name], inverses[name], counts[name] = np.unique(
                batch.sparse[name].ravel(), return_inverse=True, return_counts=True)
        rows = self.exchange.fetch(uniques, self.step, train, counts if train else None)
        return rows, inverses

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def train_step(self, batch: Batch) -> tuple[float, np.ndarray | None]:
        """Forward, backward, both optimizers, expert-bias update. Returns the BCE loss of the local batch and,
        where the training forward is what serving computes (fp32, no capacity limit), its probabilities: the
        batch's scores before the model trained on it."""
        cfg = self.config
        self.tower.train()
        rows, inverses = self._lookup(batch, train=True)
        leaves = {name: self._to_device(r).requires_grad_() for name, r in rows.items()}
        pooled = {name: pool(leaves[name], self._to_device(inverses[name].astype(np.int64)), len(batch))
                  for name in leaves}
        dense = self._to_device(batch.dense)
        labels = self._to_device(batch.labels)
        with torch.autocast(self.device.type, dtype=AUTOCAST.get(cfg.precision), enabled=cfg.precision != "fp32"):
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
                found = self.all_reduce(found, dist.ReduceOp.MAX)
            self.scaler.update(bool(found.item()))
            if found.item():
                grads = {name: torch.zeros_like(g) for name, g in grads.items()}
                self.exchange.push(grads)  # the owners expect this round; zero gradients change no row
                self.dense_opt.zero_grad(set_to_none=True)
                return float(bce.detach()), None
        self.exchange.push(grads)
        self.dense_opt.step()
        self.dense_schedule.step()
        reduce = (lambda t: dist.all_reduce(t)) if self.distributed else None
        if self.model.tower.moe is not None:
            self.model.tower.moe.router.update_expert_bias(reduce)
        if self.model.tower.normalizer is not None:  # after the step: a batch is scored with the past's statistics
            self.model.tower.normalizer.update(dense, reduce)
        scores = torch.sigmoid(out.logits.detach().float()).cpu().numpy() if self._exact_training_scores else None
        return float(bce.detach()), scores

    def _record_moe(self, routing: RoutingResult) -> None:
        load = routing.tokens_per_expert.detach().to("cpu", torch.float64)
        self.moe_load = load if self.moe_load is None else self.moe_load + load
        self._moe_load_since_eval = load if self._moe_load_since_eval is None else self._moe_load_since_eval + load
        self.moe_dropped.append(float(routing.dropped_fraction))
        self.moe_aux.append(float(routing.aux_loss.detach()))
        self.moe_z.append(float(routing.z_loss.detach()))
        self._routed_pairs = routing.routed_pairs

    def _step_flops(self, samples: int) -> float:
        """Model FLOPs of one training step on this rank: 3x forward, with the experts' routed (kept) pairs."""
        tower = self.model.tower
        flops = samples * tower.dense_flops_per_sample()
        if tower.moe is not None:
            flops += self._routed_pairs * tower.moe.expert_flops_per_pair()
        return 3.0 * flops

    def _progressive(self, batch: Batch, scores: np.ndarray) -> None:
        """Record the scores a batch got before its training step (gathered from every rank)."""
        parts: tuple[np.ndarray | None, ...] = (scores, batch.labels, batch.prob, batch.time)
        if self.distributed:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, parts)
            parts = tuple(None if gathered[0][i] is None else np.concatenate([g[i] for g in gathered])
                          for i in range(4))
        prob, labels, oracle, times = parts
        assert prob is not None and labels is not None, "every rank has scores and labels"
        self.progressive.add(prob, labels, oracle=oracle, time=times)

    # ---- publishing ---------------------------------------------------------------------------------------
    def publish_changes(self) -> int:
        """Hand this rank's rows changed since the last publish, and deletes of evicted or expired rows, to the
        background publisher; returns rows handed over. Waits only while the publisher is that many behind."""
        if self.sink is None:
            return 0
        job = PublishJob(self.step, make_version(self.generation, self.step))
        for name, table in self.model.tables.items():
            deletes, keys, rows = table.take_changes()
            if deletes.size or keys.size:
                job.tables[name] = TableChanges(deletes, keys, rows)
        t0 = time.perf_counter()
        self.sink.submit(job)
        self.publish_wait_s += time.perf_counter() - t0
        return job.rows

    @property
    def rows_published(self) -> int:
        """Rows the broker acknowledged so far."""
        return self.sink.rows_published if self.sink is not None else 0

    @property
    def last_version(self) -> int | None:
        """The newest version the broker acknowledged."""
        return self.sink.last_version if self.sink is not None else None

    # ---- evaluation ---------------------------------------------------------------------------------------
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities (fp32, eval mode, dropless) with rows as the server serves them (all ranks call
        together)."""
        rows, inverses = self._lookup(batch, train=False)
        return predict_from_rows(self.model.tower, {n: rows[n][inverses[n]] for n in rows}, batch)

    def evaluate(self, elapsed_s: float) -> EvalPoint:
        """Held-out AUC and log-loss (and the oracle's, where known) when the data has a held-out set, next to the
        rolling progressive ones; appended to ``history``."""
        holdout = self.data.holdout(self.config.holdout_size, self.step)
        held = dict.fromkeys(("auc", "log_loss", "oracle_auc", "oracle_log_loss"))
        if holdout is not None:
            prob = self.predict(holdout.rows(shard_rows(len(holdout), self.rank, self.world)))
            if self.distributed:
                parts: list[Any] = [None] * self.world
                dist.all_gather_object(parts, prob)
                prob = np.concatenate(parts)
            held = {"auc": auc(prob, holdout.labels), "log_loss": log_loss(prob, holdout.labels),
                    "oracle_auc": auc(holdout.prob, holdout.labels) if holdout.prob is not None else None,
                    "oracle_log_loss": log_loss(holdout.prob, holdout.labels) if holdout.prob is not None else None}
        load = None
        if self._moe_load_since_eval is not None:
            total = self._moe_load_since_eval
            if self.distributed:
                total = self.all_reduce(total)
            load = (total / total.sum().clamp(min=1)).tolist()
            self._moe_load_since_eval = None
        rolling = self.progressive.rolling()
        point = EvalPoint(step=self.step, elapsed_s=elapsed_s, expert_load=load, progressive_auc=rolling["auc"],
                          progressive_log_loss=rolling["log_loss"], progressive_oracle_auc=rolling["oracle_auc"],
                          **held)
        self.history.append(point)
        return point

    # ---- collectives, checkpoints and exports ---------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or ``op``) over the ranks; through the GPU when the group is nccl, which takes no host tensors."""
        on = tensor.to(self.device) if dist.get_backend() == "nccl" else tensor
        dist.all_reduce(on, op=op)
        return on.to(tensor.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (all ranks together), then commit the input position."""
        return checkpointing.save(self)

    def restore(self) -> bool:
        """Load the newest checkpoint when resuming; refuse to start over a directory that has one otherwise."""
        return checkpointing.restore(self)

    def export(self) -> None:
        """Write the dense tower as an artifact of the current version (rank 0), after this step's rows are
        acknowledged: on the publisher's thread when there is one."""
        self._exported_step = self.step
        if self.config.export_dir is None or self.rank != 0:
            self.barrier()
            return
        tower = copy.deepcopy(self.model.tower).to("cpu")
        version, step, dest = make_version(self.generation, self.step), self.step, self.config.export_dir
        features = {"data": self.data.describe(), "default": "hashed_random"}

        def write() -> None:
            self.exports.append(export_tower(dest, tower, self.model_name, version, step, features))

        if self.sink is not None:
            self.sink.submit(write)
        else:
            write()
        self.barrier()

    # ---- the run ------------------------------------------------------------------------------------------
    def _stopping(self) -> bool:
        """Whether any rank was asked to stop (the ranks agree, so all stop after the same step)."""
        if not self.distributed:
            return self.stop.is_set()
        flag = self.all_reduce(torch.tensor([1.0 if self.stop.is_set() else 0.0]), dist.ReduceOp.MAX)
        return bool(flag.item())

    def run(self, metrics_path: Path | None = None) -> dict[str, Any]:
        """Train until ``config.steps``, the end of the data or ``request_stop``, publishing, evaluating,
        checkpointing and exporting."""
        cfg = self.config
        if self.publisher is not None:
            self.journal = PublishJournal(cfg.checkpoint_dir / f"rank{self.rank}") if cfg.checkpoint_dir else None
            self.sink = BackgroundPublisher(self.publisher, self.journal, cfg.max_pending_publishes)
        progress = progress_bar() if cfg.progress and self.rank == 0 else None
        start = time.perf_counter()
        try:
            self.restore()
            self._loop(start, progress)
            if self.sink is not None:
                self.publish_changes()
            if not self.history or self.history[-1].step != self.step:
                self.evaluate(time.perf_counter() - start)
            if cfg.export_dir is not None and self._exported_step != self.step:
                self.export()
            if self.sink is not None:
                self.sink.drain()  # the final checkpoint then has nothing left to publish
            if cfg.checkpoint_dir is not None:
                self.save_checkpoint()
        finally:
            if progress is not None:
                progress.stop()
            if self.sink is not None:
                self.sink.close()
            if self.journal is not None:
                self.journal.close()
        metrics = run_metrics(self, time.perf_counter() - start)
        if metrics_path is not None and self.rank == 0:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text(json.dumps(metrics, indent=2))
        return metrics

    def _loop(self, start: float, progress: Any) -> None:
        cfg = self.config
        drift = self.data.drift
        last_publish_t = start
        steps_since_publish = 0
        loss_ema: float | None = None
        last = None
        task = None
        if progress is not None:
            total = cfg.steps or self.data.total_steps(cfg.batch_size, self.position)
            task = progress.add_task("train", total=total, stats="", completed=self.step)
            progress.start()
        expire_every = max(1, (cfg.expire_after_steps or 1) // 16)
        t_ready, cpu_ready = time.perf_counter(), time.process_time()
        for batch, position, global_size in self.data.batches(cfg.batch_size, self.position, self.rank, self.world,
                                                              stop=self.stop):
            data_s = time.perf_counter() - t_ready  # reading and encoding this rank's rows
            if self._stopping() or (cfg.steps is not None and self.step >= cfg.steps):
                break
            if batch is None:  # a stream with nothing new: publish what is pending on time
                if steps_since_publish and time.perf_counter() - last_publish_t >= cfg.publish_every_s:
                    self.publish_changes()
                    steps_since_publish, last_publish_t = 0, time.perf_counter()
                t_ready, cpu_ready = time.perf_counter(), time.process_time()
                continue
            if self.world > 1 and global_size < cfg.batch_size:
                break  # ranks need equal shards: the last short batch of a pass is left out
            if drift is not None and self.step == drift.step and (not self.history or
                                                                  self.history[-1].step != self.step):
                self.evaluate(time.perf_counter() - start)
            t0 = time.perf_counter()
            scores = None if self._exact_training_scores else self.predict(batch)
            loss, trained_scores = self.train_step(batch)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            if scores is None:
                scores = trained_scores
            assert scores is not None, "the training step scores the batch where predict did not"
            self._progressive(batch, scores)
            self.cpu_s += time.process_time() - cpu_ready
            flops = self._step_flops(len(batch))
            self.window.append((data_s + dt, global_size, flops))
            self.train_s += dt
            self.data_s += data_s
            self.samples += global_size
            self.flops += flops
            self.step += 1
            self.position = position
            loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
            if cfg.expire_after_steps is not None and self.step % expire_every == 0:
                for table in self.model.tables.values():
                    table.expire(self.step, cfg.expire_after_steps)
            steps_since_publish += 1
            if self.sink is not None and (steps_since_publish >= cfg.publish_every_steps
                                          or time.perf_counter() - last_publish_t >= cfg.publish_every_s):
                self.publish_changes()
                steps_since_publish, last_publish_t = 0, time.perf_counter()
            if self.step % cfg.eval_every == 0:
                last = self.evaluate(time.perf_counter() - start)
            if cfg.export_every is not None and self.step % cfg.export_every == 0:
                if self.sink is not None and steps_since_publish:
                    self.publish_changes()
                    steps_since_publish = 0
                self.export()
            if cfg.checkpoint_dir is not None and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            if progress is not None and task is not None:
                shown = last.auc if last is not None and last.auc is not None else self.progressive.rolling()["auc"]
                progress.update(task, completed=self.step, stats=f"{self.samples_per_s():,.0f} samples/s  "
                                f"loss {loss_ema:.4f}  AUC {'-' if shown is None else f'{shown:.4f}'}")
            t_ready, cpu_ready = time.perf_counter(), time.process_time()

    def samples_per_s(self) -> float:
        """Global samples/s over the last ``throughput_window`` steps: reading the data and the training step
        (publishing, evaluations, checkpoints and exports not included)."""
        seconds = sum(w[0] for w in self.window)
        return sum(w[1] for w in self.window) / seconds if seconds > 0 else 0.0
