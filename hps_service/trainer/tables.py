"""The trainer's embedding tables: keyed by any int64, rows created on first sight, bounded, row-wise Adagrad.

A row is created the first time its key is trained, initialised to exactly what the server's ``hashed_random``
default answers for that key, so a key the trainer has not published yet reads the same from the server as from
the trainer. A table holds at most ``max_rows`` rows; when a new key needs room the rows unused for longest are
evicted, and those the server may hold are queued as deletes for the next publish (after which the server again
answers the same default as the trainer would re-create). Rows live in host memory in fp32 with one Adagrad
accumulator each (FBGEMM's EXACT_ROWWISE_ADAGRAD: ``G += mean(g^2)``, ``w -= lr * g / (sqrt(G) + eps)``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from hps_service.defaults import hashed_random_rows
from hps_service.errors import InvalidArgumentError
from hps_service.trainer.keyindex import KeyIndex

EmbeddingOptimizer = Literal["adagrad", "sgd"]


class EmbeddingTable:
    """One table's rows, optimizer state, last-use step and publish bookkeeping, addressed by int64 key."""

    def __init__(
        self, name: str, dim: int, max_rows: int, optimizer: EmbeddingOptimizer = "adagrad", lr: float = 0.2,
        eps: float = 1e-8, initial_rows: int = 4096,
    ) -> None:
        if dim < 1 or max_rows < 1:
            raise InvalidArgumentError(f"table {name!r}: dim and max_rows must be >= 1")
        if optimizer not in ("adagrad", "sgd"):
            raise InvalidArgumentError(f"embedding optimizer must be adagrad or sgd, got {optimizer!r}")
        if lr <= 0:
            raise InvalidArgumentError(f"embedding learning rate must be > 0, got {lr}")
        self.name, self.dim, self.max_rows = name, dim, max_rows
        self.optimizer, self.lr, self.eps = optimizer, lr, eps
        cap = min(max_rows, max(initial_rows, 16))
        self.weight = torch.zeros(cap, dim)
        self.accum = torch.zeros(cap)
        self.keys = np.zeros(cap, dtype=np.int64)
        self.last_used = np.zeros(cap, dtype=np.int64)
        self.live = np.zeros(cap, dtype=bool)
        self.published = np.zeros(cap, dtype=bool)  # the server may hold a row for this key
        self.dirty = np.zeros(cap, dtype=bool)  # changed since it was last published
        self.index = KeyIndex(cap)
        self._high = 0  # slots below this have been used
        self._free: list[np.ndarray] = []
        self._deletes: list[np.ndarray] = []
        self.evictions = 0

    @property
    def rows(self) -> int:
        return self.index.count

    # ---- reading --------------------------------------------------------------------------------------------
    def read(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` as the server answers them: held rows, else the hashed_random default; (n, dim)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        slots = self.index.find(keys)
        out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        held = slots >= 0
        out[held] = self.weight.numpy()[slots[held]]
        if not held.all():
            out[~held] = hashed_random_rows(keys[~held], self.dim)
        return out

    def fetch_for_training(self, keys: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots, rows) of distinct ``keys``, creating missing rows (evicting cold ones when full)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if keys.shape[0] > self.max_rows:
            raise InvalidArgumentError(
                f"table {self.name!r}: one batch holds {keys.shape[0]} distinct ids but --max-rows-per-table is "
                f"{self.max_rows}"
            )
        slots = self.index.find(keys)
        new = slots < 0
        if new.any():
            slots[new] = self._create(keys[new], protect=slots[~new])
        self.last_used[slots] = step
        return slots, self.weight.numpy()[slots]

    def _create(self, keys: np.ndarray, protect: np.ndarray) -> np.ndarray:
        overflow = self.rows + keys.shape[0] - self.max_rows
        if overflow > 0:
            self._evict(overflow + self.max_rows // 64, protect)
        slots = self._allocate(keys.shape[0])
        self.index.insert(keys, slots)
        self.keys[slots] = keys
        self.weight.numpy()[slots] = hashed_random_rows(keys, self.dim)
        self.accum.numpy()[slots] = 0.0
        self.live[slots] = True
        self.published[slots] = False
        self.dirty[slots] = True
        return slots

    def _allocate(self, n: int) -> np.ndarray:
        free = np.concatenate(self._free) if self._free else np.zeros(0, dtype=np.int32)
        take, rest = free[:n], free[n:]
        self._free = [rest] if rest.size else []
        fresh = n - take.size
        if self._high + fresh > self.weight.shape[0]:
            self._grow(self._high + fresh)
        out = np.concatenate([take, np.arange(self._high, self._high + fresh, dtype=np.int32)])
        self._high += fresh
        return out

    def _grow(self, needed: int) -> None:
        cap = self.weight.shape[0]
        while cap < needed:
            cap *= 2
        cap = min(cap, self.max_rows)
        extra = cap - self.weight.shape[0]
        self.weight = torch.cat([self.weight, torch.zeros(extra, self.dim)])
        self.accum = torch.cat([self.accum, torch.zeros(extra)])
        for name in ("keys", "last_used", "live", "published", "dirty"):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros(extra, dtype=arr.dtype)]))

    def _evict(self, count: int, protect: np.ndarray) -> None:
        """Drop the ``count`` live rows unused for longest (never those in ``protect``)."""
        candidates = np.flatnonzero(self.live[: self._high]).astype(np.int32)
        if protect.size:
            candidates = candidates[~np.isin(candidates, protect)]
        count = min(count, candidates.size)
        if count <= 0:
            return
        victims = candidates[np.argpartition(self.last_used[candidates], count - 1)[:count]]
        keys = self.keys[victims]
        self.index.remove(keys)
        was_published = self.published[victims]
        if was_published.any():
            self._deletes.append(keys[was_published])
        self.live[victims] = False
        self.dirty[victims] = False
        self.published[victims] = False
        self._free.append(victims)
        self.evictions += int(count)

    # ---- training -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_gradients(self, slots: np.ndarray, grads: torch.Tensor) -> None:
        """One optimizer step for distinct ``slots`` with their (summed) gradients (n, dim) float32."""
        if slots.size == 0:
            return
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        grads = grads.to(torch.float32)
        if self.optimizer == "adagrad":
            acc = self.accum.index_select(0, index) + grads.pow(2).mean(dim=1)
            self.accum.index_copy_(0, index, acc)
            grads = grads / (acc.sqrt() + self.eps).unsqueeze(1)
        self.weight.index_add_(0, index, grads, alpha=-self.lr)
        self.dirty[slots] = True

    # ---- publishing -----------------------------------------------------------------------------------------
    def take_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys to delete, keys changed, their rows) since the last call; marks the changed rows published.

        A key evicted and created again since the last call is published, not deleted.
        """
        deletes = np.unique(np.concatenate(self._deletes)) if self._deletes else np.zeros(0, dtype=np.int64)
        self._deletes = []
        slots = np.flatnonzero(self.dirty[: self._high])
        keys = self.keys[slots]
        if deletes.size and keys.size:
            deletes = deletes[~np.isin(deletes, keys)]
        rows = self.weight.numpy()[slots].copy()
        self.dirty[slots] = False
        self.published[slots] = True
        return deletes, keys, rows

    def mark_all_changed(self) -> None:
        """Every held row is published again at the next ``take_changes`` (after a resume)."""
        self.dirty[: self._high] = self.live[: self._high]

    def pending(self) -> int:
        return int(self.dirty[: self._high].sum()) + sum(int(d.size) for d in self._deletes)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """The held rows and their state, as arrays (what a checkpoint stores)."""
        slots = np.flatnonzero(self.live[: self._high])
        deletes = np.concatenate(self._deletes) if self._deletes else np.zeros(0, dtype=np.int64)
        return {
            "keys": self.keys[slots].copy(), "rows": self.weight.numpy()[slots].copy(),
            "accum": self.accum.numpy()[slots].copy(), "last_used": self.last_used[slots].copy(),
            "published": self.published[slots].copy(), "dirty": self.dirty[slots].copy(), "deletes": deletes,
        }

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Add rows from ``state`` (possibly a subset of another layout's shard) into an empty table."""
        keys = np.asarray(state["keys"], dtype=np.int64)
        if self.rows:
            raise InvalidArgumentError(f"table {self.name!r} must be empty to load a checkpoint")
        if keys.size > self.max_rows:
            raise InvalidArgumentError(
                f"table {self.name!r}: the checkpoint holds {keys.size} rows, more than --max-rows-per-table "
                f"{self.max_rows}"
            )
        rows = np.asarray(state["rows"], dtype=np.float32)
        if rows.shape != (keys.size, self.dim):
            raise InvalidArgumentError(f"table {self.name!r}: checkpoint rows have shape {rows.shape}, not "
                                       f"({keys.size}, {self.dim})")
        slots = self._allocate(keys.size)
        self.index.insert(keys, slots)
        self.keys[slots] = keys
        self.weight.numpy()[slots] = rows
        self.accum.numpy()[slots] = state["accum"]
        self.last_used[slots] = state["last_used"]
        self.live[slots] = True
        self.published[slots] = state["published"]
        self.dirty[slots] = state["dirty"]
        deletes = np.asarray(state.get("deletes", np.zeros(0)), dtype=np.int64)
        if deletes.size:
            self._deletes.append(deletes)
