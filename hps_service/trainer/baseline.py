"""Logistic regression on the same data (one weight per id per field, plus dense weights): the bar DLRM must clear."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import Batch, PlantedTeacherData
from hps_service.trainer.optim import SparseRowOptimizer


class LogisticRegression(nn.Module):
    """logit = bias + w_dense . x + sum over fields of the weight of each id in the bag."""

    def __init__(self, fields: tuple[str, ...], cardinalities: tuple[int, ...], num_dense: int) -> None:
        super().__init__()
        self.fields = fields
        bags = {name: nn.EmbeddingBag(card, 1, mode="sum", sparse=True) for name, card in zip(fields, cardinalities)}
        for bag in bags.values():
            nn.init.zeros_(bag.weight)
        self.id_weights = nn.ModuleDict(bags)
        self.bags = bags  # the same modules, as EmbeddingBags (a ModuleDict yields them as plain Modules)
        self.dense = nn.Linear(num_dense, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        logit = self.dense(torch.from_numpy(batch.dense)).squeeze(-1)
        for name in self.fields:
            logit = logit + self.id_weights[name](torch.from_numpy(batch.sparse[name])).squeeze(-1)
        return logit

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        return torch.sigmoid(self.forward(batch)).numpy()


def train_logistic_baseline(
    data: PlantedTeacherData, steps: int, batch_size: int, lr: float = 0.05, seed: int = 0
) -> LogisticRegression:
    """Fit logistic regression on the first ``steps`` training batches (row-wise Adagrad for ids, Adam for dense)."""
    if steps < 1 or batch_size < 1:
        raise InvalidArgumentError("baseline steps and batch_size must be >= 1")
    torch.manual_seed(seed)
    cfg = data.config
    model = LogisticRegression(cfg.fields, cfg.cardinalities, cfg.num_dense)
    sparse_opt = SparseRowOptimizer(model.bags, lr=lr)
    dense_opt = torch.optim.Adam(model.dense.parameters(), lr=1e-2)
    for step in range(steps):
        batch = data.batch(step, batch_size)
        loss = F.binary_cross_entropy_with_logits(model(batch), torch.from_numpy(batch.labels))
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
    return model
