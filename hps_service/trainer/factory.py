"""Builds a matching (model, data) pair from a served model's config: one sparse field per table, same names/dims."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hps_service.config import ModelConfig
from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import DriftSpec, PlantedTeacherData, TeacherConfig
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig


@dataclass(frozen=True)
class RunSpec:
    """What the served config does not say: id ranges, features, MoE shape, drift."""

    cardinality: int = 1000
    num_dense: int = 4
    experts: int = 4
    top_k: int = 2
    expert_ffn_hidden: int = 32
    expert_bias: bool = True
    capacity_factor: float | None = None
    shared_expert_hidden: int = 32
    cluster_weight: float = 0.5
    seed: int = 0
    drift_step: int | None = None
    drift_ids: int = 0


def build_run(model: ModelConfig, spec: RunSpec) -> tuple[DLRM, PlantedTeacherData]:
    """A DLRM whose tables are ``model``'s tables and a planted teacher with one field per table.

    With drift, the ``drift_ids`` most frequent ids of the first table are re-drawn at ``drift_step``.
    """
    if spec.cardinality < 1:
        raise InvalidArgumentError(f"cardinality must be >= 1, got {spec.cardinality}")
    fields = tuple(t.name for t in model.tables)
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
    moe = None
    if spec.experts > 0:
        moe = MoEConfig(
            num_experts=spec.experts, top_k=min(spec.top_k, spec.experts), ffn_hidden=spec.expert_ffn_hidden,
            expert_bias=spec.expert_bias, capacity_factor=spec.capacity_factor,
            shared_expert_hidden=spec.shared_expert_hidden,
        )
    dlrm = DLRMConfig(
        tables=tuple(TableSpec(t.name, t.dim, spec.cardinality) for t in model.tables),
        num_dense=spec.num_dense,
        moe=moe,
    )
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model_instance = DLRM(dlrm)
    return model_instance, PlantedTeacherData(teacher)
