"""DLRM whose embedding tables are the parameter server's tables, with an optional MoE block after the interaction.

The model is split in two: ``DLRM.tables`` (one table per sparse field, named like the server's tables, keyed by any
int64, summed over each sample's bag) and ``DenseTower`` (bottom MLP, an interaction: pairwise dots (DLRM) or
DCN-v2 cross layers, MoE block, top MLP). Inference elsewhere fetches embedding rows from the server and runs only the dense tower:
``predict_from_rows`` (or ``hps_service.trainer.predictor.Predictor``, which loads an exported tower).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import Batch
from hps_service.trainer.interaction import CrossNetwork
from hps_service.trainer.moe import MoEConfig, MoELayer, RoutingResult
from hps_service.trainer.normalize import DenseNormalizer
from hps_service.trainer.tables import EmbeddingTable


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: the server's table name and its row width."""

    name: str
    dim: int


@dataclass(frozen=True)
class DLRMConfig:
    """Layer sizes; ``interaction_dim`` defaults to the widest table (tables of another width get a projection).

    ``interaction``: ``dot`` (DLRM: the bottom output and every pairwise dot of the F+1 vectors) or ``dcn``
    (DCN-v2: ``dcn_layers`` full-rank cross layers over the F+1 vectors concatenated). ``normalize_dense``: the
    dense features are standardised with running statistics before the bottom MLP (``normalize.DenseNormalizer``).
    """

    tables: tuple[TableSpec, ...]
    num_dense: int
    bottom_hidden: tuple[int, ...] = (32,)
    top_hidden: tuple[int, ...] = (64, 32)
    interaction_dim: int | None = None
    moe: MoEConfig | None = None
    moe_hidden: int = 32
    interaction: Literal["dot", "dcn"] = "dot"
    dcn_layers: int = 2
    normalize_dense: bool = False

    def __post_init__(self) -> None:
        if not self.tables:
            raise InvalidArgumentError("DLRM needs at least one embedding table")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"table names must be unique, got {names}")
        for t in self.tables:
            if t.dim < 1:
                raise InvalidArgumentError(f"table {t.name!r}: dim must be >= 1")
        if self.num_dense < 1:
            raise InvalidArgumentError(f"num_dense must be >= 1, got {self.num_dense}")
        if any(h < 1 for h in self.bottom_hidden + self.top_hidden) or self.moe_hidden < 1:
            raise InvalidArgumentError("layer sizes must be >= 1")
        if self.interaction_dim is not None and self.interaction_dim < 1:
            raise InvalidArgumentError(f"the interaction width must be >= 1, got {self.interaction_dim}")
        if self.interaction not in ("dot", "dcn"):
            raise InvalidArgumentError(f"--interaction must be dot or dcn, not {self.interaction!r}")
        if self.dcn_layers < 1:
            raise InvalidArgumentError(f"--dcn-layers must be >= 1, got {self.dcn_layers}")

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

    pair_rows: torch.Tensor  # buffers, registered in __init__
    pair_cols: torch.Tensor

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.resolved_interaction_dim
        self.normalizer = DenseNormalizer(config.num_dense) if config.normalize_dense else None
        self.bottom = _mlp([config.num_dense, *config.bottom_hidden, d], relu_last=True)
        self.projections = nn.ModuleDict(
            {t.name: (nn.Identity() if t.dim == d else nn.Linear(t.dim, d, bias=False)) for t in config.tables}
        )
        n_vec = len(config.tables) + 1
        rows, cols = torch.triu_indices(n_vec, n_vec, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        if config.interaction == "dcn":
            self.cross: CrossNetwork | None = CrossNetwork(n_vec * d, config.dcn_layers)
            inter_out = n_vec * d
        else:
            self.cross = None
            inter_out = d + rows.numel()
        if config.moe is not None:
            self.moe_in: nn.Linear | None = nn.Linear(inter_out, config.moe_hidden)
            self.moe: MoELayer | None = MoELayer(config.moe_hidden, config.moe)
            top_in = config.moe_hidden
        else:
            self.moe_in = None
            self.moe = None
            top_in = inter_out
        self.top = _mlp([top_in, *config.top_hidden, 1], relu_last=False)

    def forward(self, dense: torch.Tensor, pooled: Mapping[str, torch.Tensor]) -> TowerOutput:
        bottom = self.bottom(dense if self.normalizer is None else self.normalizer(dense))
        vectors = [bottom] + [self.projections[name](pooled[name]) for name in self.config.table_names]
        stacked = torch.stack(vectors, dim=1)  # (B, F+1, d)
        if self.cross is not None:
            features = self.cross(stacked.flatten(1))
        else:
            gram = torch.bmm(stacked, stacked.transpose(1, 2))
            features = torch.cat([bottom, gram[:, self.pair_rows, self.pair_cols]], dim=1)
        routing = None
        if self.moe is not None:
            assert self.moe_in is not None, "moe_in and moe are built together"
            hidden = F.relu(self.moe_in(features))
            moe_out = self.moe(hidden)
            features = hidden + moe_out.output
            routing = moe_out.routing
        return TowerOutput(logits=self.top(features).squeeze(-1), routing=routing)

    def flops_per_sample(self) -> int:
        """Nominal forward FLOPs of one sample, 2 x GEMM sizes (Linear layers, interaction bmm, MoE with k experts)."""
        flops = self.dense_flops_per_sample()
        if self.moe is not None:
            flops += self.moe.config.top_k * self.moe.expert_flops_per_pair()
        return flops

    def dense_flops_per_sample(self) -> int:
        """Forward FLOPs every sample costs whatever the routing: all but the routed experts."""
        flops = 0
        inside_moe = set(self.moe.modules()) if self.moe is not None else set()
        for module in self.modules():
            if isinstance(module, nn.Linear) and module not in inside_moe:
                flops += 2 * module.in_features * module.out_features
        n_vec = len(self.config.tables) + 1
        if self.cross is None:  # the pairwise dots; cross layers are Linear layers, counted above
            flops += 2 * n_vec * n_vec * self.config.resolved_interaction_dim
        if self.moe is not None:
            flops += self.moe.router_flops_per_token()
        return flops


class DLRM:
    """Embedding tables keyed by any int64 (``tables[name]``) feeding a ``DenseTower``."""

    def __init__(self, config: DLRMConfig, max_rows_per_table: int = 1_000_000) -> None:
        self.config = config
        self.tower = DenseTower(config)
        self.tables = {t.name: EmbeddingTable(t.name, t.dim, max_rows_per_table) for t in config.tables}

    def rows_for(self, batch: Batch) -> dict[str, np.ndarray]:
        """Rows of every id of the batch (``batch.sparse[t].ravel()`` order) as the server would answer them."""
        for name in self.config.table_names:
            if name not in batch.sparse:
                raise InvalidArgumentError(f"batch has no ids for table {name!r}")
        return {name: self.tables[name].read(batch.sparse[name].ravel()) for name in self.config.table_names}

    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of the batch from the model's own tables (eval mode, fp32, on the CPU)."""
        return predict_from_rows(self.tower, self.rows_for(batch), batch)

    def table_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Current float32 rows of ``keys`` (the hashed_random default for keys not held): what the server serves."""
        if table not in self.tables:
            raise InvalidArgumentError(f"model has no table {table!r}")
        return self.tables[table].read(np.asarray(keys, dtype=np.int64))


def pool(rows: torch.Tensor, inverse: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Sum each sample's bag: ``rows[inverse]`` viewed as (batch, bag, dim), summed over the bag."""
    return rows.index_select(0, inverse).view(batch_size, -1, rows.shape[-1]).sum(dim=1)


@torch.no_grad()
def predict_from_rows(dense_model: DenseTower, rows_by_table: Mapping[str, np.ndarray], batch: Batch) -> np.ndarray:
    """Click probabilities from the dense tower and embedding rows fetched elsewhere (e.g. ``HPSClient.lookup``).

    ``rows_by_table[table]`` holds the rows of ``batch.sparse[table].ravel()`` in that order, shape
    (batch * bag_size, dim), exactly what a lookup of those keys returns.
    """
    device = next(dense_model.parameters()).device
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
        pooled[spec.name] = torch.from_numpy(rows).to(device).reshape(ids.shape[0], ids.shape[1], spec.dim).sum(dim=1)
    was_training = dense_model.training
    dense_model.eval()
    try:
        logits = dense_model(torch.from_numpy(batch.dense).to(device), pooled).logits
    finally:
        dense_model.train(was_training)
    return torch.sigmoid(logits.float()).cpu().numpy().astype(np.float32)
