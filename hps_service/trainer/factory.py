"""Builds a matching (model, data source) pair from a served model's config: one sparse field per table.

``--data`` names files or directories (read once), ``dir:///path`` (with ``--follow``: trained as files land) or
``kafka://brokers/topic`` (trained until stopped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from hps_service.config import ModelConfig
from hps_service.errors import InvalidArgumentError
from hps_service.trainer.criteo import DENSE_FIELDS, CriteoFiles, expand_paths
from hps_service.trainer.data import DriftSpec, PlantedTeacherData, TeacherConfig
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.sources import DataSource, FileSource, SyntheticSource
from hps_service.trainer.stream_sources import DirectorySource, KafkaSource

DataFormat = Literal["synthetic", "criteo", "parquet"]


@dataclass(frozen=True)
class RunSpec:
    """What the served config does not say: the data, the MoE shape, table bounds, drift (synthetic)."""

    data_format: DataFormat = "synthetic"
    data: tuple[str, ...] = ()
    eval_data: tuple[str, ...] = ()
    holdout_last: int = 0
    follow: bool = False
    kafka_group: str | None = None
    bottom_mlp: tuple[int, ...] | None = None
    top_mlp: tuple[int, ...] | None = None
    interaction: str = "dot"
    dcn_layers: int = 2
    cardinality: int = 1000
    num_dense: int = 4
    experts: int = 4
    top_k: int = 2
    expert_ffn_hidden: int = 32
    shared_expert_hidden: int = 32
    moe: dict[str, Any] = field(default_factory=dict)
    max_rows_per_table: int = 1_000_000
    cluster_weight: float = 0.5
    seed: int = 0
    drift_step: int | None = None
    drift_ids: int = 0


def _stream(model: ModelConfig, spec: RunSpec, fields: tuple[str, ...]) -> DataSource | None:
    """A Kafka or directory source when ``--data`` names one; None for plain files."""
    url = spec.data[0] if len(spec.data) == 1 else None
    streams = [d for d in spec.data if d.startswith(("kafka://", "dir://"))]
    if streams and url is None:
        raise InvalidArgumentError("a kafka:// or dir:// source must be the only --data")
    if spec.follow and url is None:
        raise InvalidArgumentError("--follow needs one --data dir:///path")
    if url is None or not (streams or spec.follow):
        return None
    if spec.holdout_last or spec.eval_data:
        raise InvalidArgumentError("a stream has no last rows to hold out: progressive validation measures it "
                                   "(drop --holdout / --eval-data)")
    fmt = None if spec.data_format == "synthetic" else spec.data_format
    if url.startswith("kafka://"):
        if spec.follow:
            raise InvalidArgumentError("--follow is for a dir:// source; a kafka:// source always follows")
        return KafkaSource(url, fields, group=spec.kafka_group or f"hps-trainer.{model.name}")
    path = Path(url[len("dir://"):] if url.startswith("dir://") else url)
    return DirectorySource(path, fields, follow=spec.follow, data_format=fmt)


def _source(model: ModelConfig, spec: RunSpec) -> DataSource:
    fields = tuple(t.name for t in model.tables)
    if spec.data and spec.drift_step is not None:
        raise InvalidArgumentError("--drift-step is for synthetic data only")
    stream = _stream(model, spec, fields) if spec.data else None
    if stream is not None:
        return stream
    if spec.data_format in ("criteo", "parquet"):
        if not spec.data:
            raise InvalidArgumentError(f"--data-format {spec.data_format} needs --data PATH")
        files = CriteoFiles(expand_paths(spec.data), spec.data_format, fields)
        evals = CriteoFiles(expand_paths(spec.eval_data), spec.data_format, fields) if spec.eval_data else None
        return FileSource(files, holdout_last=spec.holdout_last, eval_files=evals)
    if spec.data_format != "synthetic":
        raise InvalidArgumentError(f"--data-format must be synthetic, criteo or parquet, not {spec.data_format!r}")
    if spec.data:
        raise InvalidArgumentError("--data needs --data-format criteo or parquet")
    if spec.cardinality < 1:
        raise InvalidArgumentError(f"cardinality must be >= 1, got {spec.cardinality}")
    cards = (spec.cardinality,) * len(fields)
    probe = TeacherConfig(fields=fields, cardinalities=cards, num_dense=spec.num_dense, seed=spec.seed)
    drift = None
    if spec.drift_step is not None:
        if not 1 <= spec.drift_ids <= spec.cardinality:
            raise InvalidArgumentError(f"drift_ids must be in [1, {spec.cardinality}] when a drift step is given")
        hottest = PlantedTeacherData.hottest_ids(probe, field_index=0, count=spec.drift_ids)
        drift = DriftSpec(step=spec.drift_step, field=fields[0], ids=tuple(int(i) for i in hottest))
    teacher = TeacherConfig(
        fields=fields, cardinalities=cards, num_dense=spec.num_dense, seed=spec.seed,
        cluster_weight=spec.cluster_weight, drift=drift,
    )
    return SyntheticSource(PlantedTeacherData(teacher))


def _num_dense(spec: RunSpec) -> int:
    return spec.num_dense if spec.data_format == "synthetic" and not spec.data else len(DENSE_FIELDS)


def build_run(model: ModelConfig, spec: RunSpec) -> tuple[DLRM, DataSource]:
    """A DLRM whose tables are ``model``'s tables and a data source with one sparse field per table.

    With synthetic drift, the ``drift_ids`` most frequent ids of the first table are re-drawn at ``drift_step``.
    """
    moe = None
    if spec.experts > 0:
        if spec.top_k > spec.experts:
            raise InvalidArgumentError(f"--top-k {spec.top_k} is more than the {spec.experts} --experts")
        moe = MoEConfig(
            num_experts=spec.experts, top_k=spec.top_k, ffn_hidden=spec.expert_ffn_hidden,
            shared_expert_hidden=spec.shared_expert_hidden, **spec.moe,
        )
    towers: dict[str, Any] = {"interaction": spec.interaction, "dcn_layers": spec.dcn_layers}
    if spec.bottom_mlp is not None:  # the last width is the interaction's: tables of another width are projected
        if not spec.bottom_mlp:
            raise InvalidArgumentError("--bottom-mlp needs at least one width")
        towers.update(bottom_hidden=tuple(spec.bottom_mlp[:-1]), interaction_dim=spec.bottom_mlp[-1])
    if spec.top_mlp is not None:
        towers["top_hidden"] = tuple(spec.top_mlp)
    dlrm = DLRMConfig(tables=tuple(TableSpec(t.name, t.dim) for t in model.tables), num_dense=_num_dense(spec),
                      moe=moe, **towers)
    source = _source(model, spec)
    if dlrm.num_dense != source.num_dense:
        raise InvalidArgumentError(f"the model takes {dlrm.num_dense} dense features, the data has {source.num_dense}")
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model_instance = DLRM(dlrm, max_rows_per_table=spec.max_rows_per_table)
    return model_instance, source
