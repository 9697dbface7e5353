"""Sparse optimizers for embedding tables (row-wise Adagrad or SGD)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from hps_service.errors import InvalidArgumentError


class SparseRowOptimizer:
    """Applies the sparse gradients of EmbeddingBag tables to the touched rows only.

    ``adagrad`` is row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row,
    ``G_r += mean(g_r^2)``, ``w_r -= lr * g_r / (sqrt(G_r) + eps)``. ``sgd`` is ``w_r -= lr * g_r``.
    """

    def __init__(
        self,
        tables: Mapping[str, nn.EmbeddingBag],
        lr: float,
        kind: Literal["adagrad", "sgd"] = "adagrad",
        eps: float = 1e-8,
        initial_accumulator: float = 0.0,
    ) -> None:
        if kind not in ("adagrad", "sgd"):
            raise InvalidArgumentError(f"embedding optimizer must be adagrad or sgd, got {kind!r}")
        if lr <= 0:
            raise InvalidArgumentError(f"embedding learning rate must be > 0, got {lr}")
        self.tables = dict(tables)
        self.lr = lr
        self.kind = kind
        self.eps = eps
        self.accumulators = {
            name: torch.full((bag.weight.shape[0],), float(initial_accumulator)) for name, bag in self.tables.items()
        }

    @torch.no_grad()
    def step(self) -> dict[str, torch.Tensor]:
        """Update every table with a gradient, clear it, and return the unique row ids updated per table."""
        touched: dict[str, torch.Tensor] = {}
        for name, bag in self.tables.items():
            grad = bag.weight.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad = grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
            else:
                rows = torch.nonzero(grad.abs().sum(dim=1), as_tuple=True)[0]
                values = grad[rows]
            if self.kind == "adagrad":
                acc = self.accumulators[name]
                acc[rows] += values.pow(2).mean(dim=1)
                values = values / (acc[rows].sqrt() + self.eps).unsqueeze(1)
            bag.weight.index_add_(0, rows, values, alpha=-self.lr)
            bag.weight.grad = None
            touched[name] = rows
        return touched
