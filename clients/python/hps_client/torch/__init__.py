"""Served tables inside PyTorch models (``pip install 'hps-client[torch]'``): :class:`HPSEmbedding` and
:class:`HPSEmbeddingBag` answer what ``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag`` would over the served rows,
through the ``torch.ops.hps`` custom ops that ``torch.compile`` and ``torch.export`` carry.

    from hps_client import HPSClient
    from hps_client.torch import HPSEmbeddingBag

    bag = HPSEmbeddingBag(HPSClient("hps:8500"), "demo", "item", mode="sum")
    pooled = bag(ids, offsets)                      # (bags, dim) float32, on ids' device
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # the client-only install has no torch
    raise ImportError("hps_client.torch needs PyTorch: pip install 'hps-client[torch]'") from exc

from hps_client.torch import ops
from hps_client.torch.modules import HPSEmbedding, HPSEmbeddingBag
from hps_client.torch.prefetch import Prefetch

__all__ = ["HPSEmbedding", "HPSEmbeddingBag", "Prefetch", "ops"]
