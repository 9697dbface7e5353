"""DCN-v2 cross layers (Wang et al., 2021): explicit feature crosses of a bounded degree, one Linear layer each.

``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` with a full-rank ``W_l``: after L layers every product of up to L + 1
input features can be represented. The output has the input's width.
"""

from __future__ import annotations

import torch
from torch import nn


class CrossNetwork(nn.Module):
    """``layers`` full-rank cross layers over a ``width``-wide input."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        linears = [nn.Linear(width, width) for _ in range(layers)]
        for layer in linears:
            nn.init.xavier_uniform_(layer.weight, gain=0.5)
            nn.init.zeros_(layer.bias)
        self.layers = nn.ModuleList(linears)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x
