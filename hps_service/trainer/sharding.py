"""How a training step reaches the embedding rows: from this process's tables, or from their owners by all-to-all.

Data-parallel training keeps the embeddings model-parallel, as HugeCTR does: the row of a key lives on rank
``partition_of(key) % world_size`` (the partition the update topic routes the key to), every rank trains the dense
tower on its share of the batch under DDP, and each step exchanges keys, rows and row gradients with two
``all_to_all_single`` rounds each way. An owner sums the gradients a row receives from every rank and divides by
the world size (DDP averages the dense gradients the same way), then applies row-wise Adagrad once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from hps_service.trainer.tables import EmbeddingTable
from hps_service.updates.partitioning import partition_of
from hps_service.updates.topics import DEFAULT_PARTITIONS


class Exchange(Protocol):
    """Rows for the distinct keys of a batch, and their gradients back to whoever owns them."""

    def fetch(self, keys: Mapping[str, np.ndarray], step: int, train: bool,
              counts: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]: ...

    def push(self, grads: Mapping[str, torch.Tensor]) -> None: ...


class LocalExchange:
    """One process owns every row."""

    def __init__(self, tables: Mapping[str, EmbeddingTable]) -> None:
        self.tables = dict(tables)
        self._slots: dict[str, np.ndarray] = {}

    def fetch(self, keys: Mapping[str, np.ndarray], step: int, train: bool,
              counts: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Rows of each table's distinct ``keys`` (seen ``counts`` times); with ``train`` missing rows of admitted
        ids are created (and kept for push)."""
        out = {}
        for name, k in keys.items():
            if train:
                self._slots[name], out[name] = self.tables[name].fetch_for_training(
                    k, step, counts[name] if counts is not None else None)
            else:
                out[name] = self.tables[name].read(k)
        return out

    def push(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Apply the gradients of the rows of the last training fetch."""
        for name, g in grads.items():
            self.tables[name].apply_gradients(self._slots[name], g)


@dataclass
class _FetchedStep:
    """What a training fetch leaves for its push: the splits of both sides and the rows this rank owns."""

    send_counts: np.ndarray  # [dest, table]
    recv_counts: np.ndarray  # [source, table]
    orders: list[np.ndarray]  # per table: the permutation that groups the keys given by owner
    starts: np.ndarray  # [dest + 1, table]: where each owner's keys start in the grouped order
    owned: dict[str, tuple[np.ndarray, np.ndarray]]  # per table: (slots, inverse) of the rows asked of this rank


class AllToAllExchange:
    """Each rank owns the keys with ``partition_of(key, partitions) % world == rank``; the rest come by all-to-all."""

    def __init__(
        self, tables: Mapping[str, EmbeddingTable], partitions: int = DEFAULT_PARTITIONS,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.tables = dict(tables)
        self.names = list(self.tables)
        self.dims = np.array([self.tables[n].dim for n in self.names], dtype=np.int64)
        self.partitions = partitions
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self._step: _FetchedStep | None = None

    def owner(self, keys: np.ndarray) -> np.ndarray:
        """The rank that owns each key."""
        return partition_of(keys, self.partitions).astype(np.int64) % self.world

    def _all_to_all(self, send: np.ndarray, send_splits: np.ndarray, recv_splits: np.ndarray) -> np.ndarray:
        inp = torch.from_numpy(np.ascontiguousarray(send)).to(self.device)
        out = torch.empty(int(recv_splits.sum()), dtype=inp.dtype, device=self.device)
        dist.all_to_all_single(out, inp, [int(x) for x in recv_splits], [int(x) for x in send_splits],
                               group=self.group)
        return out.cpu().numpy()

    def fetch(self, keys: Mapping[str, np.ndarray], step: int, train: bool,
              counts: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Rows of each table's distinct ``keys`` from their owners (every rank must call this together). For
        admission an owner counts an id once per rank whose share of the batch holds it (``counts`` unused)."""
        world, names = self.world, self.names
        send_counts = np.zeros((world, len(names)), dtype=np.int64)  # [dest, table]
        orders, grouped = [], []
        for t, name in enumerate(names):
            k = np.ascontiguousarray(keys[name], dtype=np.int64)
            owner = self.owner(k)
            order = np.argsort(owner, kind="stable")
            orders.append(order)
            grouped.append(k[order])
            send_counts[:, t] = np.bincount(owner, minlength=world)
        starts = np.concatenate([np.zeros((1, len(names)), dtype=np.int64), np.cumsum(send_counts, axis=0)])
        send_keys = np.concatenate(
            [grouped[t][starts[r, t]:starts[r + 1, t]] for r in range(world) for t in range(len(names))]
        )
        recv_counts = self._all_to_all(send_counts.ravel(), np.full(world, len(names)), np.full(world, len(names)))
        recv_counts = recv_counts.reshape(world, len(names))  # [source, table]
        recv_keys = self._all_to_all(send_keys, send_counts.sum(axis=1), recv_counts.sum(axis=1))
        # owner side: the keys each source asked for, per table, source-major
        offsets = np.concatenate([[0], np.cumsum(recv_counts.ravel())]).reshape(-1)
        asked: list[np.ndarray] = []
        served: list[np.ndarray] = []
        owned: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t, name in enumerate(names):
            parts = [recv_keys[offsets[s * len(names) + t]:offsets[s * len(names) + t + 1]] for s in range(world)]
            all_keys = np.concatenate(parts)
            unique, inverse, asking = np.unique(all_keys, return_inverse=True, return_counts=True)
            if train:
                slots, rows = self.tables[name].fetch_for_training(unique, step, asking)
                owned[name] = (slots, inverse)
            else:
                rows = self.tables[name].read(unique)
            asked.append(recv_counts[:, t])
            served.append(rows[inverse])
        row_offsets = [np.concatenate([[0], np.cumsum(recv_counts[:, t])]) for t in range(len(names))]
        send_rows = np.concatenate(
            [served[t][row_offsets[t][s]:row_offsets[t][s + 1]].ravel() for s in range(world)
             for t in range(len(names))]
        ).astype(np.float32, copy=False)
        got = self._all_to_all(send_rows, recv_counts @ self.dims, send_counts @ self.dims)
        # requester side: put the rows back in the order the keys were given
        out: dict[str, np.ndarray] = {}
        pieces: dict[int, list[np.ndarray]] = {t: [] for t in range(len(names))}
        pos = 0
        for r in range(world):
            for t in range(len(names)):
                n = int(send_counts[r, t]) * int(self.dims[t])
                pieces[t].append(got[pos:pos + n].reshape(-1, int(self.dims[t])))
                pos += n
        for t, name in enumerate(names):
            rows = np.empty((orders[t].size, int(self.dims[t])), dtype=np.float32)
            rows[orders[t]] = np.concatenate(pieces[t])
            out[name] = rows
        if train:
            self._step = _FetchedStep(send_counts, recv_counts, orders, starts, owned)
        return out

    def push(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Send the gradients of the last training fetch to the owners, who apply them (all ranks together)."""
        assert self._step is not None, "push without a training fetch"
        st = self._step
        counts, recv_counts, orders, starts = st.send_counts, st.recv_counts, st.orders, st.starts
        names = self.names
        grouped = [grads[n].detach().to("cpu", torch.float32).numpy()[orders[t]] for t, n in enumerate(names)]
        send = np.concatenate(
            [grouped[t][starts[r, t]:starts[r + 1, t]].ravel() for r in range(self.world) for t in range(len(names))]
        )
        got = self._all_to_all(send, counts @ self.dims, recv_counts @ self.dims)
        pieces: dict[int, list[np.ndarray]] = {t: [] for t in range(len(names))}
        pos = 0
        for s in range(self.world):
            for t in range(len(names)):
                n = int(recv_counts[s, t]) * int(self.dims[t])
                pieces[t].append(got[pos:pos + n].reshape(-1, int(self.dims[t])))
                pos += n
        for t, name in enumerate(names):
            slots, inverse = st.owned[name]
            summed = torch.zeros(slots.size, int(self.dims[t]))
            summed.index_add_(0, torch.from_numpy(inverse.astype(np.int64)), torch.from_numpy(np.concatenate(pieces[t])))
            self.tables[name].apply_gradients(slots, summed / self.world)
        self._step = None
