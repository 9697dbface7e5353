"""``hps train`` and ``hps predict``: train the DLRM/MoE model of a served config online; score with what it exported.

``hps train`` also runs data-parallel under torchrun (``torchrun --nproc-per-node 2 -m hps_service.trainer ...``):
gloo on the CPU, nccl on GPUs. Torch is imported only when a command runs, so the rest of ``hps`` starts without it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from hps_service.config import ConfigError, load_config
from hps_service.errors import HPSError, InvalidArgumentError
from hps_service.rows.formats import STORAGES

if TYPE_CHECKING:  # the trainer's modules import torch, which the rest of hps starts without
    from hps_service.trainer.criteo import FileFormat
    from hps_service.trainer.factory import DataFormat
    from hps_service.trainer.precision import Precision
    from hps_service.trainer.tables import EmbeddingOptimizer

_Choice = TypeVar("_Choice", bound=str)
_DATA_FORMATS: tuple[DataFormat, ...] = ("synthetic", "criteo", "parquet")
_FILE_FORMATS: tuple[FileFormat, ...] = ("criteo", "parquet")
_PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")
_EMBEDDING_OPTIMIZERS: tuple[EmbeddingOptimizer, ...] = ("adagrad", "sgd")

CONFIG_OPTION = typer.Option(..., "--config", "-c", help="hps config YAML: the model's tables (names, dims) and "
                             "updates.brokers / updates.topic_prefix for publishing.")
METRICS_OPTION = typer.Option(Path("var/train-metrics.json"), "--metrics-out", help="Where to write the metrics JSON.")
DATA_OPTION = typer.Option(None, "--data", help="Training data (repeatable): Criteo TSV or Parquet files or "
                           "directories, read once; dir:///path (with --follow: files trained as they land); or "
                           "kafka://host:port/topic (Criteo lines or a Parquet batch per message, until stopped).")


def _widths(text: str | None, option: str) -> tuple[int, ...] | None:
    """``512,256,64`` -> (512, 256, 64)."""
    if text is None:
        return None
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"{option} takes comma-separated layer widths, e.g. 512,256,64; got {text!r}") from None
    if not widths or min(widths) < 1:
        raise InvalidArgumentError(f"{option}: every width must be >= 1, got {text!r}")
    return widths


def _holdout_last(text: str | None) -> int:
    """``last:N`` -> N; ``none`` or nothing -> 0."""
    if text is None or text == "none":
        return 0
    kind, _, count = text.partition(":")
    if kind != "last" or not count.isdigit() or int(count) < 2:
        raise InvalidArgumentError(f"--holdout takes last:N (N >= 2, the newest N rows of the data) or none, "
                                   f"not {text!r}")
    return int(count)


def _choice(value: str, choices: tuple[_Choice, ...], option: str) -> _Choice:
    """``value`` as the one of ``choices`` it names."""
    for choice in choices:
        if value == choice:
            return choice
    raise InvalidArgumentError(f"{option} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}")


def _data_format(data_format: str | None, data: list[str] | None, choices: tuple[_Choice, ...]) -> _Choice:
    """``--data-format`` (one of ``choices``), else synthetic without data, parquet for .parquet/.pq files, criteo."""
    if data_format is None and not data:
        data_format = "synthetic"
    elif data_format is None:
        data_format = "parquet" if all(str(p).endswith((".parquet", ".pq")) for p in data or ()) else "criteo"
    return _choice(data_format, choices, "--data-format")


def _init_distributed(device: str) -> str:
    """Join the torchrun process group when WORLD_SIZE > 1; returns this process's device."""
    import torch
    import torch.distributed as dist

    from hps_service.trainer.train import resolve_device

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return f"cuda:{local}"
    dist.init_process_group("gloo")
    return "cpu"


def train_command(
    config: Path = CONFIG_OPTION,
    steps: int | None = typer.Option(None, "--steps", min=1, help="Training steps (one global batch each); "
                                     "default: 1000 on synthetic data, one pass over files, until stopped (SIGTERM) "
                                     "on a stream. Given, the dense learning rate decays over them after warm-up."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model to train; default: the config's first."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Samples per step, over all processes."),
    data: list[str] | None = DATA_OPTION,
    data_format: str | None = typer.Option(None, "--data-format", help="synthetic, criteo (TSV) or parquet; "
                                           "default: synthetic without --data, else from the file names."),
    follow: bool = typer.Option(False, "--follow", help="With --data dir:///path: keep training on files as they "
                                "land (name order), until stopped."),
    holdout: str | None = typer.Option(None, "--holdout", help="last:N: hold out the newest N rows of the files "
                                       "(never trained) and evaluate on them; default: none (progressive "
                                       "validation only)."),
    eval_data: list[str] | None = typer.Option(None, "--eval-data", help="Held-out file(s), instead of --holdout."),
    holdout_size: int = typer.Option(20000, "--holdout-size", min=2, help="Synthetic data: held-out samples per "
                                     "evaluation (and --eval-data rows read)."),
    progressive_window: int = typer.Option(100_000, "--progressive-window", min=2, help="Samples of the rolling "
                                           "progressive AUC and log-loss (each scored before training on it)."),
    kafka_group: str | None = typer.Option(None, "--kafka-group", help="kafka:// source: the consumer group its "
                                           "offsets are committed to after each checkpoint (default "
                                           "hps-trainer.<model>)."),
    max_rows_per_table: int = typer.Option(10_000_000, "--max-rows-per-table", min=1, help="Rows a table holds in "
                                           "one process; the coldest are evicted (published as deletes)."),
    admit_after: int = typer.Option(1, "--admit-after", min=1, max=65535, help="An id gets a trained, published "
                                    "row once seen this many times (count-min sketch); until then the default."),
    expire_after_steps: int | None = typer.Option(None, "--expire-after-steps", min=1, help="Evict rows unused "
                                                  "for this many steps (published as deletes)."),
    bottom_mlp: str | None = typer.Option(None, "--bottom-mlp", help="Bottom MLP widths, e.g. 512,256,64; the "
                                          "last is the interaction width (default: 32,<widest table dim>)."),
    top_mlp: str | None = typer.Option(None, "--top-mlp", help="Top MLP hidden widths, e.g. 512,256 (default "
                                       "64,32)."),
    interaction: str = typer.Option("dot", "--interaction", help="dot (DLRM pairwise dots) or dcn (DCN-v2 cross "
                                    "layers)."),
    dcn_layers: int = typer.Option(2, "--dcn-layers", min=1, help="Cross layers of --interaction dcn."),
    normalize_dense: bool = typer.Option(False, "--normalize-dense", help="Standardise the dense features with "
                                         "the running mean and variance of the samples trained on (exported with "
                                         "the tower): for features far from centred, e.g. counts and rates."),
    cardinality: int = typer.Option(1000, "--cardinality", min=1, help="Synthetic data: ids per table."),
    num_dense: int = typer.Option(4, "--num-dense", min=1, help="Synthetic data: dense features per sample."),
    experts: int = typer.Option(4, "--experts", min=0, help="Routed experts of the MoE block; 0: no MoE block."),
    top_k: int = typer.Option(2, "--top-k", min=1, help="Experts per sample."),
    expert_hidden: int = typer.Option(32, "--moe-ffn-hidden", min=1, help="Hidden size of each routed expert."),
    shared_expert_hidden: int = typer.Option(32, "--moe-shared-expert-hidden", min=0, help="Hidden size of the "
                                             "shared expert; 0: none."),
    score_function: str = typer.Option("sigmoid", "--moe-score-function", help="sigmoid or softmax."),
    pre_softmax: bool = typer.Option(False, "--moe-pre-softmax/--no-moe-pre-softmax", help="Softmax before top-k."),
    expert_bias: bool = typer.Option(True, "--moe-expert-bias/--no-moe-expert-bias", help="Aux-loss-free balancing "
                                     "(DeepSeek-V3; sigmoid scores only)."),
    bias_update_rate: float = typer.Option(1e-3, "--moe-bias-update-rate", help="Expert bias step per update."),
    aux_loss_coeff: float = typer.Option(0.0, "--moe-aux-loss-coeff", help="Switch load-balancing loss weight."),
    seq_aux_loss_coeff: float = typer.Option(1e-4, "--moe-seq-aux-loss-coeff", help="Sequence aux loss weight "
                                             "(DeepSeek-V3); 0: off."),
    seq_length: int = typer.Option(32, "--moe-seq-length", min=1, help="Consecutive samples that form one sequence "
                                   "for the sequence aux loss."),
    z_loss_coeff: float = typer.Option(0.0, "--moe-z-loss-coeff", help="Router z-loss weight; 0: off."),
    capacity_factor: float | None = typer.Option(None, "--capacity-factor", help="Expert capacity factor; "
                                                 "tokens beyond it are dropped (default: no limit)."),
    drop_policy: str = typer.Option("probs", "--moe-drop-policy", help="Which tokens a full expert drops: probs "
                                    "(lowest probability) or position (latest)."),
    pad_to_capacity: bool = typer.Option(False, "--moe-pad-to-capacity", help="Pad every expert to capacity."),
    num_groups: int | None = typer.Option(None, "--moe-num-groups", help="Group-limited routing: expert groups."),
    group_topk: int | None = typer.Option(None, "--moe-group-topk", help="Group-limited routing: groups per token."),
    topk_scaling_factor: float | None = typer.Option(None, "--moe-topk-scaling-factor", help="Scale of the top-k "
                                                     "weights."),
    embedding_optimizer: str = typer.Option("adagrad", "--embedding-optimizer", help="adagrad (row-wise) or sgd."),
    embedding_lr: float = typer.Option(0.2, "--embedding-lr", help="Learning rate of the embedding tables."),
    dense_lr: float = typer.Option(1e-2, "--dense-lr", help="Adam learning rate of the dense part."),
    warmup_steps: int = typer.Option(0, "--warmup-steps", min=0, help="Steps of linear warm-up of the dense "
                                     "learning rate (default none); then constant, decaying only when --steps is "
                                     "given."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16 (autocast for the dense part)."),
    publish: bool = typer.Option(True, "--publish/--no-publish", help="Publish changed rows to Kafka "
                                 "(needs updates.type kafka in the config, or --brokers)."),
    brokers: str | None = typer.Option(None, "--brokers", help="Kafka bootstrap host:port; overrides the config."),
    model_version: int = typer.Option(0, "--model-version", min=0, max=2**31 - 1, help="Publish to this version of "
                                      "the model (POST /v1/models/{model}/versions adds it); 0: the model itself."),
    publish_precision: str = typer.Option("fp32", "--publish-precision", help="Publish rows as fp32, fp16, bf16 "
                                          "or int8 (a 2-4x smaller log; replicas store each table in its own "
                                          "tables[].storage)."),
    publish_every_steps: int = typer.Option(50, "--publish-every-steps", min=1, help="Publish after this many "
                                            "steps ..."),
    publish_every_s: float = typer.Option(1.0, "--publish-every-s", help="... or this many seconds, "
                                          "whichever comes first."),
    generation: int = typer.Option(0, "--generation", min=0, help="High 32 bits of every row version; raise it "
                                   "for each new training run so its rows win over older runs."),
    eval_every: int = typer.Option(100, "--eval-every", min=1, help="Steps between held-out evaluations."),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Write checkpoints here."),
    checkpoint_every: int = typer.Option(1000, "--checkpoint-every", min=1, help="Steps between checkpoints "
                                         "(one is also written at exit)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in --checkpoint-dir."),
    export_dir: str | None = typer.Option(None, "--export-dir", help="Export the dense tower here (DIR or "
                                          "s3://bucket/prefix) for `hps predict` / Predictor."),
    export_every: int | None = typer.Option(None, "--export-every", min=1, help="Steps between exports (one is "
                                            "also written at exit)."),
    drift_step: int | None = typer.Option(None, "--drift-step", help="Synthetic data: step at which the teacher "
                                          "re-draws the true rows of the hottest ids of the first table."),
    drift_ids: int = typer.Option(50, "--drift-ids", min=1, help="How many hottest ids drift."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data, the teacher and the model."),
    metrics_out: Path = METRICS_OPTION,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    threads: int = typer.Option(1, "--threads", min=0, help="torch intra-op threads; 0: torch's default. One "
                                "is fastest for these small GEMMs on a shared CPU (spinning threads stall there)."),
) -> None:
    """Train DLRM (+ MoE) on Criteo-format files or synthetic data; publish changed rows; export the dense tower."""
    console = Console(stderr=True, soft_wrap=True)
    try:  # torch comes with the optional 'trainer' extra; the rest of hps must start without it
        import pyarrow
        import torch
        import torch.distributed as dist

        from hps_service.trainer.factory import RunSpec, build_run
        from hps_service.trainer.train import TrainConfig, Trainer
    except ImportError as exc:
        console.print("[red]error:[/red] " + escape(f"hps train needs the trainer extra (pip install "
                                                     f"'hps-service[trainer]'): {exc}"))
        raise typer.Exit(2) from None
    if threads:
        torch.set_num_threads(threads)
    publisher = None
    source = None
    rank = 0
    try:
        device = _init_distributed(device)
        rank = dist.get_rank() if dist.is_initialized() else 0
        cfg = load_config(config)
        if not cfg.models:
            raise InvalidArgumentError(f"config {config} defines no models")
        model_cfg = cfg.model(model) if model else cfg.models[0]
        if model_cfg is None:
            raise InvalidArgumentError(f"model {model!r} is not in {config}")
        embedding_opt = _choice(embedding_optimizer, _EMBEDDING_OPTIMIZERS, "--embedding-optimizer")
        publish_as = _choice(publish_precision, STORAGES, "--publish-precision")
        fmt = _data_format(data_format, data, _DATA_FORMATS)
        moe = {
            "score_function": score_function, "pre_softmax": pre_softmax, "expert_bias": expert_bias,
            "bias_update_rate": bias_update_rate, "aux_loss_coeff": aux_loss_coeff,
            "seq_aux_loss_coeff": seq_aux_loss_coeff, "seq_length": seq_length, "z_loss_coeff": z_loss_coeff,
            "capacity_factor": capacity_factor, "drop_policy": drop_policy, "pad_to_capacity": pad_to_capacity,
            "num_groups": num_groups, "group_topk": group_topk, "topk_scaling_factor": topk_scaling_factor,
        }
        spec = RunSpec(
            data_format=fmt, data=tuple(data or ()), eval_data=tuple(eval_data or ()),
            holdout_last=_holdout_last(holdout), follow=follow, kafka_group=kafka_group,
            bottom_mlp=_widths(bottom_mlp, "--bottom-mlp"), top_mlp=_widths(top_mlp, "--top-mlp"),
            interaction=interaction, dcn_layers=dcn_layers, normalize_dense=normalize_dense,
            cardinality=cardinality, num_dense=num_dense, experts=experts, top_k=top_k,
            expert_ffn_hidden=expert_hidden, shared_expert_hidden=shared_expert_hidden, moe=moe,
            max_rows_per_table=max_rows_per_table, seed=seed, drift_step=drift_step,
            drift_ids=drift_ids if drift_step is not None else 0,
        )
        dlrm, source = build_run(model_cfg, spec)
        if rank == 0:
            other = [t.name for t in model_cfg.tables if t.default != "hashed_random"]
            if other:
                console.print(f"[yellow]tables {other} do not default to hashed_random in {config}: ids the "
                              "trainer has not published yet will read differently from the server")
        train_cfg = TrainConfig(
            steps=steps if steps is not None or fmt != "synthetic" else 1000, batch_size=batch_size,
            embedding_optimizer=embedding_opt,
            embedding_lr=embedding_lr, dense_lr=dense_lr, publish_every_steps=publish_every_steps,
            publish_every_s=publish_every_s, eval_every=eval_every, holdout_size=holdout_size,
            generation=generation, progress=progress, device=device,
            precision=_choice(precision, _PRECISIONS, "--precision"),
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume, export_dir=export_dir,
            export_every=export_every, warmup_steps=warmup_steps, progressive_window=progressive_window,
            admit_after=admit_after, expire_after_steps=expire_after_steps,
        )
        target = brokers or (cfg.updates.brokers if cfg.updates.type == "kafka" else None)
        if publish and target:
            from hps_service.updates import Publisher

            # librdkafka's settings, passed on to the producer: their dotted names are none of Publisher's parameters
            producer_config: dict[str, Any] = dict(cfg.updates.kafka_config)
            publisher = Publisher(target, model_cfg.name, cfg.updates.topic_prefix,
                                  partitions=cfg.cluster.partitions, replication_factor=cfg.updates.replication_factor,
                                  min_insync_replicas=cfg.updates.min_insync_replicas,
                                  precision=publish_as, model_version=model_version, **producer_config)
        elif publish and rank == 0:
            console.print("[yellow]updates are disabled in the config and no --brokers given: not publishing")
        trainer = Trainer(dlrm, source, train_cfg, publisher, model_name=model_cfg.name,
                          partitions=cfg.cluster.partitions)
        # SIGTERM: finish the step, publish, checkpoint (committing a Kafka source's offsets after it), exit 0.
        # pyarrow's own handler would cancel a CSV read in flight with ArrowCancelled instead (seen in CI)
        pyarrow.enable_signal_handlers(False)
        previous = signal.signal(signal.SIGTERM, lambda *_: trainer.request_stop())
        try:
            metrics = trainer.run(metrics_out)
        finally:
            signal.signal(signal.SIGTERM, previous)
            pyarrow.enable_signal_handlers(True)
        if dist.is_initialized():
            # every rank done before any tears its process group down: a rank that destroys it while another is
            # still in its last collective makes gloo abort that one ("terminate called without an active exception")
            dist.barrier()
    except (ConfigError, HPSError) as exc:
        console.print("[red]error:[/red] " + escape(str(exc)))
        raise typer.Exit(2) from None
    finally:
        if source is not None:
            source.close()
        if publisher is not None:
            publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return
    final = metrics["final"]
    oracle = f" (oracle {final['oracle_auc']:.4f})" if final["oracle_auc"] is not None else ""
    mfu = f", MFU {metrics['mfu']:.1%}" if metrics["mfu"] is not None else ""
    overall = metrics["progressive"]["overall"]["auc"]
    quality = (f"{final['kind']} AUC {final['auc']:.4f}{oracle}, log-loss {final['log_loss']:.4f}"
               if final["auc"] is not None else "no AUC yet (too few samples)")
    progressive = f", progressive AUC {overall:.4f}" if overall is not None else ""
    stopped = " (stopped)" if metrics["stopped"] else ""
    console.print(
        f"{metrics['steps']} steps{stopped}, {quality}{progressive}, {metrics['samples_per_s']:,.0f} "
        f"samples/s on {metrics['world_size']} process(es), {metrics['model_flops_per_s'] / 1e9:.2f} GFLOP/s{mfu}, "
        f"{metrics['publishing']['rows_published']:,} rows published; metrics in {metrics_out}"
    )


def predict_command(
    export_dir: str = typer.Option(..., "--export-dir", help="Where `hps train --export-dir` wrote the tower."),
    target: str = typer.Option("127.0.0.1:8500", "--target", help="hps serve host:port."),
    data: list[str] = typer.Option(..., "--data", help="Labelled Criteo-format file(s) to score."),
    data_format: str | None = typer.Option(None, "--data-format", help="criteo (TSV) or parquet; default: from the "
                                           "file names."),
    model: str | None = typer.Option(None, "--model", "-m", help="Served model name; default: the artifact's."),
    batch_size: int = typer.Option(4096, "--batch-size", min=1, help="Rows per lookup."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Score at most this many rows."),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds per lookup."),
) -> None:
    """Score labelled rows with the newest exported tower and rows served over gRPC; print AUC and log-loss."""
    console = Console(stderr=True, soft_wrap=True)
    try:
        import numpy as np

        from hps_service.trainer.metrics import auc, log_loss
        from hps_service.trainer.predictor import Predictor
    except ImportError as exc:
        console.print("[red]error:[/red] " + escape(f"hps predict needs the trainer extra: {exc}"))
        raise typer.Exit(2) from None
    try:
        fmt = _data_format(data_format, data, _FILE_FORMATS)
        with Predictor(export_dir, target, model=model, timeout=timeout) as predictor:
            probs, labels = [], []
            for p, y in predictor.score_files(data, fmt, batch_size, limit):
                probs.append(p)
                labels.append(y)
            prob, label = np.concatenate(probs), np.concatenate(labels)
            version = predictor.version
    except HPSError as exc:
        console.print("[red]error:[/red] " + escape(str(exc)))
        raise typer.Exit(2) from None
    typer.echo(f"rows {prob.size}  AUC {auc(prob, label):.4f}  log-loss {log_loss(prob, label):.4f}  "
               f"(model version {version}, rows from {target})")
