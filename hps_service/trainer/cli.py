"""``hps train``: train the DLRM/MoE model of a served config online and publish its rows to the update topic."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from hps_service.config import ConfigError, load_config
from hps_service.errors import HPSError, InvalidArgumentError

CONFIG_OPTION = typer.Option(..., "--config", "-c", help="hps config YAML: the model's tables (names, dims) and "
                             "updates.brokers / updates.topic_prefix for publishing.")
METRICS_OPTION = typer.Option(Path("var/train-metrics.json"), "--metrics-out", help="Where to write the metrics JSON.")


def train_command(
    config: Path = CONFIG_OPTION,
    steps: int = typer.Option(1000, "--steps", min=1, help="Training steps (one batch each)."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model to train; default: the config's first."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Samples per step."),
    cardinality: int = typer.Option(1000, "--cardinality", min=1, help="Ids per table; keys are 0..N-1."),
    num_dense: int = typer.Option(4, "--num-dense", min=1, help="Dense features per sample."),
    experts: int = typer.Option(4, "--experts", min=0, help="Routed experts of the MoE block; 0: no MoE block."),
    top_k: int = typer.Option(2, "--top-k", min=1, help="Experts per sample."),
    capacity_factor: float | None = typer.Option(None, "--capacity-factor", help="Expert capacity factor; "
                                                    "tokens beyond it are dropped (default: no limit)."),
    embedding_optimizer: str = typer.Option("adagrad", "--embedding-optimizer", help="adagrad (row-wise) or sgd."),
    embedding_lr: float = typer.Option(0.2, "--embedding-lr", help="Learning rate of the embedding tables."),
    dense_lr: float = typer.Option(1e-2, "--dense-lr", help="Adam learning rate of the dense part."),
    publish: bool = typer.Option(True, "--publish/--no-publish", help="Publish touched rows to Kafka "
                                 "(needs updates.type kafka in the config, or --brokers)."),
    brokers: str | None = typer.Option(None, "--brokers", help="Kafka bootstrap host:port; overrides the config."),
    publish_every_steps: int = typer.Option(50, "--publish-every-steps", min=1, help="Publish after this many "
                                            "steps ..."),
    publish_every_s: float = typer.Option(1.0, "--publish-every-s", help="... or this many seconds, "
                                          "whichever comes first."),
    generation: int = typer.Option(0, "--generation", min=0, help="High 32 bits of every row version; raise it "
                                   "for each new training run so its rows win over older runs."),
    eval_every: int = typer.Option(100, "--eval-every", min=1, help="Steps between held-out evaluations."),
    holdout_size: int = typer.Option(20000, "--holdout-size", min=2, help="Held-out samples per evaluation."),
    drift_step: int | None = typer.Option(None, "--drift-step", help="Step at which the teacher re-draws the "
                                             "true rows of the hottest ids of the first table."),
    drift_ids: int = typer.Option(50, "--drift-ids", min=1, help="How many hottest ids drift."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data, the teacher and the model."),
    metrics_out: Path = METRICS_OPTION,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    threads: int = typer.Option(1, "--threads", min=0, help="torch intra-op threads; 0: torch's default. One "
                                "is fastest for these small GEMMs on a shared CPU (spinning threads stall there)."),
) -> None:
    """Train DLRM (+ MoE) on planted-teacher data; publish changed rows; write AUC vs oracle and throughput."""
    console = Console(stderr=True, soft_wrap=True)
    try:  # torch comes with the optional 'trainer' extra; the rest of hps must start without it
        from hps_service.trainer.factory import RunSpec, build_run
        from hps_service.trainer.train import TrainConfig, Trainer
    except ImportError as exc:
        console.print("[red]error:[/red] " + escape(f"hps train needs the trainer extra (pip install "
                                                     f"'hps-service[trainer]'): {exc}"))
        raise typer.Exit(2) from None
    if threads:
        import torch

        torch.set_num_threads(threads)
    publisher = None
    try:
        cfg = load_config(config)
        if not cfg.models:
            raise InvalidArgumentError(f"config {config} defines no models")
        model_cfg = cfg.model(model) if model else cfg.models[0]
        if model_cfg is None:
            raise InvalidArgumentError(f"model {model!r} is not in {config}")
        if embedding_optimizer not in ("adagrad", "sgd"):
            raise InvalidArgumentError(f"--embedding-optimizer must be adagrad or sgd, not {embedding_optimizer!r}")
        spec = RunSpec(
            cardinality=cardinality, num_dense=num_dense, experts=experts, top_k=top_k,
            capacity_factor=capacity_factor, seed=seed, drift_step=drift_step,
            drift_ids=drift_ids if drift_step is not None else 0,
        )
        dlrm, data = build_run(model_cfg, spec)
        train_cfg = TrainConfig(
            steps=steps, batch_size=batch_size, embedding_optimizer=embedding_optimizer,  # type: ignore[arg-type]
            embedding_lr=embedding_lr, dense_lr=dense_lr, publish_every_steps=publish_every_steps,
            publish_every_s=publish_every_s, eval_every=eval_every, holdout_size=holdout_size,
            generation=generation, progress=progress,
        )
        target = brokers or (cfg.updates.brokers if cfg.updates.type == "kafka" else None)
        if publish and target:
            from hps_service.updates import Publisher

            publisher = Publisher(target, model_cfg.name, cfg.updates.topic_prefix,
                                  partitions=cfg.cluster.partitions, **cfg.updates.kafka_config)
        elif publish:
            console.print("[yellow]updates are disabled in the config and no --brokers given: not publishing")
        metrics = Trainer(dlrm, data, train_cfg, publisher).run(metrics_out)
    except (ConfigError, HPSError) as exc:
        console.print("[red]error:[/red] " + escape(str(exc)))
        raise typer.Exit(2) from None
    finally:
        if publisher is not None:
            publisher.close()
    final = metrics["final"]
    console.print(
        f"AUC {final['auc']:.4f} (oracle {final['oracle_auc']:.4f}), log-loss {final['log_loss']:.4f} "
        f"(oracle {final['oracle_log_loss']:.4f}), {metrics['samples_per_s']:,.0f} samples/s, "
        f"{metrics['model_flops_per_s'] / 1e9:.2f} GFLOP/s, "
        f"{metrics['publishing']['rows_published_per_s']:,.0f} rows published/s; metrics in {metrics_out}"
    )
