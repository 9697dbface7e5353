"""Builds a matching (model, data source) pair from a served model's config: one sparse field per table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hps_service.config import ModelConfig
from hps_service.errors import InvalidArgumentError
from hps_service.trainer.criteo import CriteoFiles, expand_paths
from hps_service.trainer.data import DriftSpec, PlantedTeacherData, TeacherConfig
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.sources import DataSource, FileSource, SyntheticSource

DataFormat = Literal["synthetic", "criteo", "parquet"]


@dataclass(frozen=True)
class RunSpec:
    """What the served config does not say: the data, the MoE shape, table bounds, drift (synthetic)."""

    data_format: DataFormat = "synthetic"
    data: tuple[str, ...] = ()
    eval_data: tuple[str, ...] = ()
    holdout_rows: int = 20_000
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


def _source(model: ModelConfig, spec: RunSpec) -> DataSource:
    fields = tuple(t.name for t in model.tables)
    if spec.data_format in ("criteo", "parquet"):
        if not spec.data:
            raise InvalidArgumentError(f"--data-format {spec.data_format} needs --data PATH")
        if spec.drift_step is not None:
            raise InvalidArgumentError("--drift-step is for synthetic data only")
        files = CriteoFiles(expand_paths(spec.data), spec.data_format, fields)
        evals = CriteoFiles(expand_paths(spec.eval_data), spec.data_format, fields) if spec.eval_data else None
        return FileSource(files, holdout_rows=spec.holdout_rows, eval_files=evals)
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


def build_run(model: ModelConfig, spec: RunSpec) -> tuple[DLRM, DataSource]:
    """A DLRM whose tables are ``model``'s tables and a data source with one sparse field per table.

    With synthetic drift, the ``drift_ids`` most frequent ids of the first table are re-drawn at ``drift_step``.
    """
    source = _source(model, spec)
    moe = None
    if spec.experts > 0:
        moe = MoEConfig(
            num_experts=spec.experts, top_k=min(spec.top_k, spec.experts), ffn_hidden=spec.expert_ffn_hidden,
            shared_expert_hidden=spec.shared_expert_hidden, **spec.moe,
        )
    dlrm = DLRMConfig(
        tables=tuple(TableSpec(t.name, t.dim) for t in model.tables), num_dense=source.num_dense, moe=moe,
    )
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model_instance = DLRM(dlrm, max_rows_per_table=spec.max_rows_per_table)
    return model_instance, source
