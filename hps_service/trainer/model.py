"""DLRM whose embedding tables are the parameter server's tables, with an optional MoE block after the interaction.

The model is split in two: ``DLRM.embeddings`` (one EmbeddingBag(sum) per sparse field, named like the server's
tables) and ``DenseTower`` (bottom MLP, pairwise dot interaction, MoE block, top MLP). Inference elsewhere fetches
embedding rows from the server and runs only the dense tower: ``predict_from_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import Batch
from hps_service.trainer.moe import MoEConfig, MoELayer, RoutingResult


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: the server's table name, its row width and the number of ids it holds."""

    name: str
    dim: int
    cardinality: int


@dataclass(frozen=True)
class DLRMConfig:
    """Layer sizes; ``interaction_dim`` defaults to the widest table (narrower tables get a projection)."""

    tables: tuple[TableSpec, ...]
    num_dense: int
    bottom_hidden: tuple[int, ...] = (32,)
    top_hidden: tuple[int, ...] = (64, 32)
    interaction_dim: int | None = None
    moe: MoEConfig | None = None
    moe_hidden: int = 32
    embedding_init_std: float = 0.1

    def __post_init__(self) -> None:
        if not self.tables:
            raise InvalidArgumentError("DLRM needs at least one embedding table")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"table names must be unique, got {names}")
        for t in self.tables:
            if t.dim < 1 or t.cardinality < 1:
                raise InvalidArgumentError(f"table {t.name!r}: dim and cardinality must be >= 1")
        if self.num_dense < 1:
            raise InvalidArgumentError(f"num_dense must be >= 1, got {self.num_dense}")
        if any(h < 1 for h in self.bottom_hidden + self.top_hidden) or self.moe_hidden < 1:
            raise InvalidArgumentError("layer sizes must be >= 1")

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    @property
    def resolved_interaction_dim(self) -> int:
        return self.interaction_dim or max(t.dim for t in self.tables)


def _mlp(sizes: list[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or relu_last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass
class TowerOutput:
    """Logits of the dense tower, and the MoE router's decisions when there is an MoE block."""

    logits: torch.Tensor
    routing: RoutingResult | None


class DenseTower(nn.Module):
    """Everything in DLRM except the embedding tables: it maps dense features + pooled rows to a logit."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.resolved_interaction_dim
        self.bottom = _mlp([config.num_dense, *config.bottom_hidden, d], relu_last=True)
        self.projections = nn.ModuleDict(
            {t.name: (nn.Identity() if t.dim == d else nn.Linear(t.dim, d, bias=False)) for t in config.tables}
        )
        n_vec = len(config.tables) + 1
        rows, cols = torch.triu_indices(n_vec, n_vec, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        inter_out = d + rows.numel()
        if config.moe is not None:
            self.moe_in = nn.Linear(inter_out, config.moe_hidden)
            self.moe = MoELayer(config.moe_hidden, config.moe)
            top_in = config.moe_hidden
        else:
            self.moe_in = None
            self.moe = None
            top_in = inter_out
        self.top = _mlp([top_in, *config.top_hidden, 1], relu_last=False)

    def forward(self, dense: torch.Tensor, pooled: Mapping[str, torch.Tensor]) -> TowerOutput:
        bottom = self.bottom(dense)
        vectors = [bottom] + [self.projections[name](pooled[name]) for name in self.config.table_names]
        stacked = torch.stack(vectors, dim=1)  # (B, F+1, d)
        gram = torch.bmm(stacked, stacked.transpose(1, 2))
        features = torch.cat([bottom, gram[:, self.pair_rows, self.pair_cols]], dim=1)
        routing = None
        if self.moe is not None:
            hidden = F.relu(self.moe_in(features))
            moe_out = self.moe(hidden)
            features = hidden + moe_out.output
            routing = moe_out.routing
        return TowerOutput(logits=self.top(features).squeeze(-1), routing=routing)

    def flops_per_sample(self) -> int:
        """Forward FLOPs of one sample counted as 2 x GEMM sizes (Linear layers, interaction bmm, MoE)."""
        flops = 0
        inside_moe = set(self.moe.modules()) if self.moe is not None else set()
        for module in self.modules():
            if isinstance(module, nn.Linear) and module not in inside_moe:
                flops += 2 * module.in_features * module.out_features
        n_vec = len(self.config.tables) + 1
        flops += 2 * n_vec * n_vec * self.config.resolved_interaction_dim
        if self.moe is not None:
            flops += self.moe.flops_per_token()
        return flops


class DLRM(nn.Module):
    """Embedding tables (``embeddings[table]``, EmbeddingBag sum, sparse grads) feeding a ``DenseTower``."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.ModuleDict()
        for t in config.tables:
            bag = nn.EmbeddingBag(t.cardinality, t.dim, mode="sum", sparse=True)
            nn.init.normal_(bag.weight, std=config.embedding_init_std)
            self.embeddings[t.name] = bag
        self.tower = DenseTower(config)

    def pooled(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Sum of each field's bag of rows, per sample."""
        out = {}
        for name in self.config.table_names:
            if name not in batch.sparse:
                raise InvalidArgumentError(f"batch has no ids for table {name!r}")
            out[name] = self.embeddings[name](torch.from_numpy(np.ascontiguousarray(batch.sparse[name])))
        return out

    def forward(self, batch: Batch) -> TowerOutput:
        return self.tower(torch.from_numpy(batch.dense), self.pooled(batch))

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of the batch from the model's own tables (eval mode)."""
        was_training = self.training
        self.eval()
        try:
            return torch.sigmoid(self.forward(batch).logits).numpy().astype(np.float32)
        finally:
            self.train(was_training)

    def table_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Current float32 values of rows ``keys`` of ``table`` (what gets published to the server)."""
        if table not in self.embeddings:
            raise InvalidArgumentError(f"model has no table {table!r}")
        weight = self.embeddings[table].weight
        keys = np.asarray(keys, dtype=np.int64)
        if keys.size and (keys.min() < 0 or keys.max() >= weight.shape[0]):
            raise InvalidArgumentError(f"keys of table {table!r} must be in [0, {weight.shape[0]})")
        with torch.no_grad():
            return weight[torch.from_numpy(keys)].numpy().copy()


@torch.no_grad()
def predict_from_rows(dense_model: DenseTower, rows_by_table: Mapping[str, np.ndarray], batch: Batch) -> np.ndarray:
    """Click probabilities from the dense tower and embedding rows fetched elsewhere (e.g. ``HPSClient.lookup``).

    ``rows_by_table[table]`` holds the rows of ``batch.sparse[table].ravel()`` in that order, shape
    (batch * bag_size, dim), exactly what a lookup of those keys returns.
    """
    pooled = {}
    for spec in dense_model.config.tables:
        if spec.name not in rows_by_table:
            raise InvalidArgumentError(f"no rows given for table {spec.name!r}")
        ids = batch.sparse[spec.name]
        # rows from the gRPC client are read-only views of the message; torch wants a writable array
        rows = np.require(rows_by_table[spec.name], dtype=np.float32, requirements=("C", "W"))
        if rows.shape != (ids.size, spec.dim):
            raise InvalidArgumentError(
                f"rows for table {spec.name!r} must have shape {(ids.size, spec.dim)}, got {rows.shape}"
            )
        pooled[spec.name] = torch.from_numpy(rows).reshape(ids.shape[0], ids.shape[1], spec.dim).sum(dim=1)
    was_training = dense_model.training
    dense_model.eval()
    try:
        logits = dense_model(torch.from_numpy(batch.dense), pooled).logits
    finally:
        dense_model.train(was_training)
    return torch.sigmoid(logits).numpy().astype(np.float32)
