"""The knobs of one training run (``TrainConfig``) and what an evaluation records (``EvalPoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.precision import Precision


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of one training run. ``batch_size`` is the global batch (split over data-parallel ranks)."""

    steps: int | None = None
    batch_size: int = 512
    embedding_optimizer: Literal["adagrad", "sgd"] = "adagrad"
    embedding_lr: float = 0.2
    dense_lr: float = 1e-2
    dense_lr_final_fraction: float = 0.1
    warmup_steps: int = 0
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
    progressive_window: int = 100_000
    admit_after: int = 1
    expire_after_steps: int | None = None
    max_pending_publishes: int = 4

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
        if self.warmup_steps < 0:
            raise InvalidArgumentError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.progressive_window < 2 or self.max_pending_publishes < 1:
            raise InvalidArgumentError("--progressive-window must be >= 2 and max_pending_publishes >= 1")
        if not 1 <= self.admit_after <= 65535:
            raise InvalidArgumentError(f"--admit-after must be in [1, 65535], got {self.admit_after}")
        if self.expire_after_steps is not None and self.expire_after_steps < 1:
            raise InvalidArgumentError(f"--expire-after-steps must be >= 1, got {self.expire_after_steps}")


@dataclass
class EvalPoint:
    """Quality at one step: held-out (when there is a held-out set) and progressive (the last samples, each scored
    before training on it), next to the oracle's on the same samples where the data has one."""

    step: int
    elapsed_s: float
    auc: float | None
    log_loss: float | None
    oracle_auc: float | None
    oracle_log_loss: float | None
    expert_load: list[float] | None = None  # share of routed tokens per expert since the previous point
    progressive_auc: float | None = None
    progressive_log_loss: float | None = None
    progressive_oracle_auc: float | None = None
