"""The metrics dict a training run ends with (also written as JSON): quality, throughput, MoE health, publishing."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hps_service.trainer.precision import peak_flops

if TYPE_CHECKING:
    from hps_service.trainer.run_config import EvalPoint
    from hps_service.trainer.train import Trainer


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
    )


def _final(trainer: Trainer) -> dict[str, Any]:
    """Held-out quality of the last evaluation where there is a held-out set, else the rolling progressive one."""
    last = trainer.history[-1]
    auc: float | None
    loss: float | None
    if last.auc is not None:
        auc, loss, oracle_auc, oracle_loss, kind = (last.auc, last.log_loss, last.oracle_auc, last.oracle_log_loss,
                                                    "holdout")
    else:
        rolling = trainer.progressive.rolling()
        auc, loss, kind = rolling["auc"], rolling["log_loss"], "progressive"
        oracle_auc, oracle_loss = rolling["oracle_auc"], rolling["oracle_log_loss"]
    return {
        "kind": kind,
        "auc": auc,
        "log_loss": loss,
        "oracle_auc": oracle_auc,
        "oracle_log_loss": oracle_loss,
        "auc_gap": oracle_auc - auc if oracle_auc is not None and auc is not None else None,
        "log_loss_gap": loss - oracle_loss if oracle_loss is not None and loss is not None else None,
    }


def run_metrics(trainer: Trainer, wall_s: float) -> dict[str, Any]:
    """Every number of the run, summed over the ranks where each rank holds a part."""
    window = trainer.window
    window_s = sum(w[0] for w in window)
    window_flops = sum(w[2] for w in window)
    totals = torch.tensor([window_flops, trainer.flops, trainer.cpu_s], dtype=torch.float64)
    if trainer.distributed:
        totals = trainer.all_reduce(totals)
    flops_per_s = float(totals[0]) / window_s if window_s > 0 else 0.0
    peak = peak_flops(trainer.device, trainer.config.precision)
    tower = trainer.model.tower
    sink = trainer.sink
    return {
        "steps": trainer.step,
        "batch_size": trainer.config.batch_size,
        "world_size": trainer.world,
        "device": str(trainer.device),
        "precision": trainer.config.precision,
        "samples": trainer.samples,
        "wall_s": wall_s,
        "train_s": trainer.train_s,
        "samples_per_s": trainer.samples_per_s(),
        "samples_per_s_whole_run": trainer.samples / (trainer.train_s + trainer.data_s) if trainer.train_s else 0.0,
        "data_s": trainer.data_s,
        # CPU seconds all ranks spent reading data and in training steps: samples per CPU second is what
        # the wall-clock samples/s would be per core on otherwise idle cores
        "train_cpu_s": float(totals[2]),
        "samples_per_cpu_s": trainer.samples / float(totals[2]) if totals[2] > 0 else 0.0,
        "throughput_window_steps": len(window),
        "model_flops_per_sample_nominal": 3 * tower.flops_per_sample(),
        "model_flops_per_s": flops_per_s,
        "model_flops_total": float(totals[1]),
        "mfu": flops_per_s / (peak * trainer.world) if peak else None,
        "final": _final(trainer),
        "progressive": trainer.progressive.report(),
        "history": [asdict(p) for p in trainer.history],
        "moe": moe_metrics(trainer),
        "tables": {name: {"rows": t.rows, "evictions": t.evictions, "expired": t.expired,
                          "not_admitted_sightings": t.not_admitted} for name, t in trainer.model.tables.items()},
        "publishing": {
            "enabled": sink is not None,
            "rows_published": sink.rows_published if sink else 0,
            "rows_deleted": sink.rows_deleted if sink else 0,
            "publishes": sink.publishes if sink else 0,
            "rows_published_per_s": (sink.rows_published if sink else 0) / max(wall_s, 1e-9),
            "last_version": sink.last_version if sink else None,
            "generation": trainer.generation,
            "republished_on_resume": trainer.republished_on_resume,
            "step_wait_s": trainer.publish_wait_s,
        },
        "fp16_skipped_steps": trainer.scaler.skipped,
        "checkpoints": trainer.checkpoints,
        "resumed_from": trainer.resumed_from,
        "position": trainer.position,
        "stopped": trainer.stop.is_set(),
        "exports": trainer.exports,
        "drift": drift_metrics(trainer),
    }


def moe_metrics(trainer: Trainer) -> dict[str, Any] | None:
    moe = trainer.model.tower.moe
    if moe is None or trainer.moe_load is None:
        return None
    load = trainer.moe_load / trainer.moe_load.sum().clamp(min=1)
    bias = moe.router.expert_bias
    return {
        "num_experts": moe.config.num_experts,
        "top_k": moe.config.top_k,
        "load_per_expert": load.tolist(),
        "max_load_over_mean": float(load.max() * load.numel()),
        "load_over_time": [{"step": p.step, "load": p.expert_load} for p in trainer.history if p.expert_load],
        "dropped_fraction": float(np.mean(trainer.moe_dropped)),
        "aux_loss": float(np.mean(trainer.moe_aux[-100:])),
        "z_loss": float(np.mean(trainer.moe_z[-100:])),
        "expert_bias": bias.tolist() if bias is not None else None,
    }


def _auc_gap(point: EvalPoint) -> float | None:
    """How far the held-out AUC is below the oracle's; None where either is unknown."""
    return None if point.oracle_auc is None or point.auc is None else point.oracle_auc - point.auc


def drift_metrics(trainer: Trainer) -> dict[str, Any] | None:
    """How the held-out AUC gap to the oracle moved at the drift step, and when it came back (points with both)."""
    drift = trainer.data.drift
    if drift is None:
        return None
    gaps = [(p, gap) for p in trainer.history if (gap := _auc_gap(p)) is not None]
    before = [(p, gap) for p, gap in gaps if p.step < drift.step]
    after = [(p, gap) for p, gap in gaps if p.step >= drift.step]
    if not before or not after:
        return {"step": drift.step, "field": drift.field, "ids": len(drift.ids), "recovered_at_step": None}
    gap_before = before[-1][1]
    at_drift, gap_at_drift = after[0]
    recovered = next(
        (p for p, gap in after[1:] if gap <= gap_before + trainer.config.recovery_tolerance), None
    )
    return {
        "step": drift.step,
        "field": drift.field,
        "ids": len(drift.ids),
        "auc_gap_before": gap_before,
        "auc_gap_at_drift": gap_at_drift,
        "recovered_at_step": recovered.step if recovered else None,
        "recovery_steps": recovered.step - drift.step if recovered else None,
        "recovery_s": recovered.elapsed_s - at_drift.elapsed_s if recovered else None,
    }
