"""Served tables in TorchRec models: :class:`HPSEmbeddingBagCollection` (``KeyedJaggedTensor -> KeyedTensor``) and
:class:`HPSEmbeddingCollection` (``-> dict[str, JaggedTensor]``), drop-in for TorchRec's own in an inference model.
Each ``EmbeddingBagConfig`` / ``EmbeddingConfig`` names a served table of the model (its ``name``) and the features
read from it, as in TorchRec; every forward is one request for all of the collection's tables.

    ebc = HPSEmbeddingBagCollection(HPSClient("hps:8500"), "dlrm", tables=ebc_configs)
    model.sparse_arch.embedding_bag_collection = ebc      # the trained EBC's rows, imported, now served

Needs TorchRec beside PyTorch (on a CPU-only machine with ``fbgemm-gpu-cpu``; see the PyTorch page of the docs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

try:
    from torchrec import EmbeddingBagConfig, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor, KeyedTensor, PoolingType
    from torchrec.modules.embedding_modules import get_embedding_names_by_table
except ImportError as exc:
    raise ImportError("hps_client.torchrec needs TorchRec: pip install 'hps-client[torch]' torchrec "
                      "(with fbgemm-gpu-cpu on a machine without CUDA)") from exc

from hps_client.errors import InvalidArgumentError, NotFoundError
from hps_client.torch import ops
from hps_client.torch.lookups import TableSpec
from hps_client.torch.modules import no_gradient_through
from hps_client.torch.prefetch import Prefetch
from hps_client.torch.sources import bind, served_dims

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


def _checked_dims(client: Any, model: str, configs: list[Any]) -> None:
    """NotFoundError for a config naming a table ``model`` lacks, InvalidArgumentError for one of another dim."""
    served = served_dims(client, model)
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"a table is configured twice: {names}")
    for c in configs:
        if c.name not in served:
            raise NotFoundError(f"model {model!r} has no table {c.name!r} (its tables: "
                                       f"{', '.join(sorted(served))})")
        if served[c.name] != c.embedding_dim:
            raise InvalidArgumentError(f"table {c.name!r} of model {model!r} is served with dim {served[c.name]}, "
                                       f"but its config says embedding_dim={c.embedding_dim}")


class _Collection(nn.Module):
    """What both collections share: configs checked against the server, features mapped to tables, the binding."""

    def __init__(self, client: Any, model: str, tables: list[Any], modes: list[str], version: int | None,
                 label: str, device: torch.device | str | None) -> None:
        super().__init__()
        if not tables:
            raise InvalidArgumentError("a collection needs at least one table config")
        _checked_dims(client, model, tables)
        for c in tables:
            if not c.feature_names:
                c.feature_names = [c.name]
        self.model, self.version, self.label = model, version, label
        self._configs = tables
        self._plan = tuple(TableSpec(c.name, m, c.embedding_dim) for c, m in zip(tables, modes))
        self.ref = bind(client, model, version, label, *(f"{s.name}:{s.mode}" for s in self._plan), plan=self._plan)
        #: Output features in order: (feature name, embedding name, table index).
        self._outputs = [(f, e, t) for t, (c, names) in enumerate(zip(tables, get_embedding_names_by_table(tables)))
                         for f, e in zip(c.feature_names, names)]
        self._device_asked = None if device is None else torch.device(device)

    @property
    def device(self) -> torch.device:
        """Where rows land (the input's device when none was asked)."""
        return self._device_asked or torch.device("cpu")

    def _where(self, features: KeyedJaggedTensor) -> tuple[list[int], list[int], torch.device]:
        """Each output feature's key position in ``features`` and table index; the device rows land on."""
        if features.variable_stride_per_key():
            raise InvalidArgumentError("a KeyedJaggedTensor of a variable batch size per key is not served")
        positions = {k: i for i, k in enumerate(features.keys())}
        missing = [f for f, _, _ in self._outputs if f not in positions]
        if missing:
            raise InvalidArgumentError(f"the KeyedJaggedTensor lacks feature(s) {', '.join(missing)} "
                                       f"(it has {', '.join(features.keys())})")
        return ([positions[f] for f, _, _ in self._outputs], [t for _, _, t in self._outputs],
                self._device_asked or features.values().device)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A TorchRec collection's weights in a state_dict are what was imported: taken as read, not loaded (the
        served rows answer), so that a trained model's state_dict loads into the serving one."""
        super()._load_from_state_dict(state_dict, prefix, *args)
        unexpected: list[str] = args[3]
        weights = (f"{prefix}embedding_bags.", f"{prefix}embeddings.")
        unexpected[:] = [k for k in unexpected if not k.startswith(weights)]


class HPSEmbeddingBagCollection(_Collection):
    """TorchRec's ``EmbeddingBagCollection`` over served tables: ``forward(KeyedJaggedTensor) -> KeyedTensor``,
    each feature pooled (``SUM`` or ``MEAN`` as its config says) by the server; ``is_weighted``: the KJT's weights
    are each id's weight (``SUM`` only)."""

    def __init__(self, client: Any, model: str, tables: list[EmbeddingBagConfig], *, is_weighted: bool = False,
                 version: int | None = None, label: str = "", device: torch.device | str | None = None) -> None:
        """``client``: an :class:`hps_client.HPSClient` or ``LocalClient``; ``version`` or ``label`` picks the
        model's version; ``device``: where rows land (default: the KJT's device)."""
        modes = []
        for c in tables:
            if c.pooling not in _MODES:
                raise InvalidArgumentError(f"table {c.name!r}: pooling {c.pooling} is not served (SUM or MEAN)")
            if is_weighted and c.pooling != PoolingType.SUM:
                raise InvalidArgumentError(f"table {c.name!r}: weighted bags are pooled with SUM only, not "
                                           f"{c.pooling}")
            modes.append(_MODES[c.pooling])
        super().__init__(client, model, tables, modes, version, label, device)
        self._is_weighted = is_weighted
        self._embedding_names = [e for _, e, _ in self._outputs]
        self._lengths_per_embedding = [tables[t].embedding_dim for _, _, t in self._outputs]

    def _args(self, features: KeyedJaggedTensor) -> tuple[Any, ...]:
        positions, table_of, device = self._where(features)
        weights = features.weights() if self._is_weighted else None
        return (self.ref, features.values(), features.offsets(), weights, features.stride(), positions, table_of,
                device)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        ref, values, offsets, weights, stride, positions, table_of, device = self._args(features)
        no_gradient_through(self, weights)
        pooled = torch.ops.hps.pooled_features(ref, values, offsets, weights, stride, positions, table_of,
                                               self._lengths_per_embedding, device)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=pooled)

    def prefetch(self, features: KeyedJaggedTensor) -> Prefetch:
        """Start looking these features up in the background; the next ``forward`` of equal features takes them."""
        ref, values, offsets, weights, stride, positions, table_of, device = self._args(features)
        return ops.prefetch_pooled_features(ref, values, offsets, weights, stride, positions, table_of, device)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)


class HPSEmbeddingCollection(_Collection):
    """TorchRec's ``EmbeddingCollection`` over served tables: ``forward(KeyedJaggedTensor) -> dict[str,
    JaggedTensor]``, every id's row (unpooled); every table of one dim, as TorchRec requires."""

    def __init__(self, client: Any, model: str, tables: list[EmbeddingConfig], *, need_indices: bool = False,
                 version: int | None = None, label: str = "", device: torch.device | str | None = None) -> None:
        """The arguments as :class:`HPSEmbeddingBagCollection`'s; ``need_indices``: each JaggedTensor carries its
        ids as its weights, as TorchRec's does."""
        dims = {c.embedding_dim for c in tables}
        if len(dims) > 1:
            raise InvalidArgumentError(f"every table of an EmbeddingCollection has one dim, got {sorted(dims)}")
        super().__init__(client, model, tables, ["sum"] * len(tables), version, label, device)
        self._need_indices = need_indices
        self._embedding_dim = int(tables[0].embedding_dim) if tables else 0

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        positions, table_of, device = self._where(features)
        values, stride = features.values(), features.stride()
        rows = torch.ops.hps.unpooled_features(self.ref, values, features.offsets(), stride, positions, table_of,
                                               self._embedding_dim, device)
        starts, lengths = features.offset_per_key(), features.lengths()
        out: dict[str, JaggedTensor] = {}
        for (_, name, _), p in zip(self._outputs, positions):
            a, b = starts[p], starts[p + 1]
            out[name] = JaggedTensor(values=rows[a:b], lengths=lengths[p * stride:(p + 1) * stride],
                                     weights=values[a:b] if self._need_indices else None)
        return out

    def prefetch(self, features: KeyedJaggedTensor) -> Prefetch:
        """Start looking these features up in the background; the next ``forward`` of equal features takes them."""
        positions, table_of, device = self._where(features)
        return ops.prefetch_unpooled_features(self.ref, features.values(), features.offsets(), features.stride(),
                                              positions, table_of, self._embedding_dim, device)

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)
