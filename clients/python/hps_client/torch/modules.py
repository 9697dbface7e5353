"""``HPSEmbedding`` and ``HPSEmbeddingBag``: a served table as a ``torch.nn`` module, answering what
``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag`` would over the served rows. Inference only: they hold no
parameters, and their rows take no gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hps_client.errors import InvalidArgumentError
from hps_client.torch import ops
from hps_client.torch.inputs import check_bag_shapes, check_ids, check_mode
from hps_client.torch.prefetch import Prefetch
from hps_client.torch.sources import bind, served_dim


def no_gradient_through(module: nn.Module, *inputs: Tensor | None) -> None:
    """InvalidArgumentError when a backward would need a gradient through ``module`` (an input that requires one,
    with autograd on): the served rows are fixed, so that gradient would be silently lost."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise InvalidArgumentError(
            f"{type(module).__name__} is inference-only: its rows are served, not trained, and no gradient flows "
            f"back through it; detach its inputs, or run under torch.no_grad() / torch.inference_mode()")


class _Served(nn.Module):
    """What both modules share: the client binding, the table's dim and where rows land."""

    def __init__(self, client: Any, model: str, table: str, *, version: int | None, label: str,
                 dim: int | None, device: torch.device | str | None) -> None:
        super().__init__()
        self.model, self.table, self.version, self.label = model, table, version, label
        #: The served table's dim (asked of the server unless given).
        self.embedding_dim = served_dim(client, model, table) if dim is None else int(dim)
        self.ref = bind(client, model, version, label, table)
        #: Where rows land; None: on the input's device.
        self.device = None if device is None else torch.device(device)

    def _device(self, ids: Tensor) -> torch.device:
        return self.device if self.device is not None else ids.device

    def extra_repr(self) -> str:
        at = f", version={self.version}" if self.version is not None else (f", label={self.label!r}"
                                                                            if self.label else "")
        return f"model={self.model!r}, table={self.table!r}, dim={self.embedding_dim}{at}"


class HPSEmbedding(_Served):
    """``torch.nn.Embedding`` over a served table: ``forward(ids)`` with int ids of any shape gives their rows,
    ``(*ids.shape, dim)`` float32, on the ids' device (or ``device``).

        emb = HPSEmbedding(HPSClient("hps:8500"), "demo", "item")
        rows = emb(torch.tensor([[1, 2], [3, 4]]))     # (2, 2, dim)
    """

    def __init__(self, client: Any, model: str, table: str, *, version: int | None = None, label: str = "",
                 dim: int | None = None, device: torch.device | str | None = None) -> None:
        """``client``: an :class:`hps_client.HPSClient` (or ``LocalClient``); ``version`` or ``label`` picks the
        model's version; ``dim``: the table's, to skip asking the server."""
        super().__init__(client, model, table, version=version, label=label, dim=dim, device=device)

    def forward(self, ids: Tensor) -> Tensor:
        check_ids(ids)
        return torch.ops.hps.embedding(self.ref, self.table, ids, self.embedding_dim, self._device(ids))

    def prefetch(self, ids: Tensor) -> Prefetch:
        """Start looking ``ids`` up in the background; the next ``forward(ids)`` with equal ids takes the rows."""
        check_ids(ids)
        return ops.prefetch_embedding(self.ref, self.table, ids, self.embedding_dim, self._device(ids))


class HPSEmbeddingBag(_Served):
    """``torch.nn.EmbeddingBag`` over a served table, pooled by the server: ``forward(input, offsets=None,
    per_sample_weights=None)`` with ``EmbeddingBag``'s semantics (a 1-D input with offsets, or a 2-D input of
    fixed-length bags; ``include_last_offset``; weights with ``"sum"``), one float32 row per bag.

        bag = HPSEmbeddingBag(client, "demo", "item", mode="mean")
        pooled = bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3]))   # (2, dim)
    """

    def __init__(self, client: Any, model: str, table: str, mode: str = "mean", *, include_last_offset: bool = False,
                 version: int | None = None, label: str = "", dim: int | None = None,
                 device: torch.device | str | None = None) -> None:
        """``mode``: ``"sum"`` or ``"mean"`` (torch's default); the rest as :class:`HPSEmbedding`'s."""
        check_mode(mode)
        super().__init__(client, model, table, version=version, label=label, dim=dim, device=device)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: Tensor, offsets: Tensor | None = None,
                per_sample_weights: Tensor | None = None) -> Tensor:
        bags = check_bag_shapes(input, offsets, per_sample_weights, self.mode, self.include_last_offset)
        no_gradient_through(self, per_sample_weights)
        return torch.ops.hps.embedding_bag(self.ref, self.table, input, offsets, per_sample_weights, self.mode,
                                           self.include_last_offset, bags, self.embedding_dim, self._device(input))

    def prefetch(self, input: Tensor, offsets: Tensor | None = None,
                 per_sample_weights: Tensor | None = None) -> Prefetch:
        """Start looking these bags up in the background; the next ``forward`` with equal arguments takes them."""
        check_bag_shapes(input, offsets, per_sample_weights, self.mode, self.include_last_offset)
        return ops.prefetch_embedding_bag(self.ref, self.table, input, offsets, per_sample_weights, self.mode,
                                          self.include_last_offset, self.embedding_dim, self._device(input))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}, include_last_offset={self.include_last_offset}"
