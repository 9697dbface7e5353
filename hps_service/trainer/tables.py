"""The trainer's embedding tables: keyed by any int64, rows created once an id is admitted, bounded, row-wise Adagrad.

A row is created when its key is trained and admitted (``admit_after``: seen that many times, counted by a
count-min sketch; until then the id reads and trains as the default and no row is published), initialised to exactly what the server's ``hashed_random``
default answers for that key, so a key the trainer has not published yet reads the same from the server as from
the trainer. A table holds at most ``max_rows`` rows; when a new key needs room the rows unused for longest are
evicted, and those the server may hold are queued as deletes for the next publish (after which the server again
answers the same default as the trainer would re-create). Rows live in host memory in fp32 with one Adagrad
accumulator each (FBGEMM's EXACT_ROWWISE_ADAGRAD: ``G += mean(g^2)``, ``w -= lr * g / (sqrt(G) + eps)``).
``expire`` evicts the rows unused for a number of steps the same way. Changed rows are kept in a dirty list, so a
publish costs what changed, not a scan of the table.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from hps_service.engine.defaults import hashed_random_rows
from hps_service.errors import InvalidArgumentError
from hps_service.trainer.keyindex import KeyIndex
from hps_service.trainer.sketch import CountMinSketch

EmbeddingOptimizer = Literal["adagrad", "sgd"]


class EmbeddingTable:
    """One table's rows, optimizer state, last-use step and publish bookkeeping, addressed by int64 key."""

    def __init__(
        self, name: str, dim: int, max_rows: int, optimizer: EmbeddingOptimizer = "adagrad", lr: float = 0.2,
        eps: float = 1e-8, initial_rows: int = 4096, admit_after: int = 1, sketch_width: int = 1 << 20,
    ) -> None:
        if dim < 1 or max_rows < 1:
            raise InvalidArgumentError(f"table {name!r}: dim and max_rows must be >= 1")
        if not 1 <= admit_after <= 65535:
            raise InvalidArgumentError(f"--admit-after must be in [1, 65535], got {admit_after}")
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
        self._dirty_slots: list[np.ndarray] = []  # the slots that became dirty, each once, in order
        self.admit_after = admit_after
        self.sketch = CountMinSketch(sketch_width) if admit_after > 1 else None
        self.index = KeyIndex(cap)
        self._high = 0  # slots below this have been used
        self._free: list[np.ndarray] = []
        self._deletes: list[np.ndarray] = []
        self.evictions = 0
        self.expired = 0
        self.not_admitted = 0  # sightings of ids answered with the default because they had not earned a row

    @property
    def rows(self) -> int:
        return self.index.count

    def set_admission(self, admit_after: int, sketch_width: int = 1 << 20) -> None:
        """Admit an id (give it a row) only once it was seen ``admit_after`` times; 1 admits every id at once."""
        if not 1 <= admit_after <= 65535:
            raise InvalidArgumentError(f"--admit-after must be in [1, 65535], got {admit_after}")
        if admit_after != self.admit_after:
            self.admit_after = admit_after
            self.sketch = CountMinSketch(sketch_width) if admit_after > 1 else None

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

    def fetch_for_training(
        self, keys: np.ndarray, step: int, counts: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(slots, rows) of distinct ``keys`` seen ``counts`` times in the batch (default once each), creating the
        missing rows of admitted ids (evicting cold ones when full). Ids not admitted get slot -1 and the default."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if keys.shape[0] > self.max_rows:
            raise InvalidArgumentError(
                f"table {self.name!r}: one batch holds {keys.shape[0]} distinct ids but --max-rows-per-table is "
                f"{self.max_rows}"
            )
        slots = self.index.find(keys)
        new = slots < 0
        if new.any() and self.sketch is not None:
            seen = self.sketch.add(keys[new], np.ones(int(new.sum())) if counts is None else counts[new])
            waiting = np.flatnonzero(new)[seen < self.admit_after]
            self.not_admitted += int(waiting.size if counts is None else counts[waiting].sum())
            new[waiting] = False
        if new.any():
            slots[new] = self._create(keys[new], protect=slots[slots >= 0])
        held = slots >= 0
        self.last_used[slots[held]] = step
        if held.all():
            return slots, self.weight.numpy()[slots]
        rows = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        rows[held] = self.weight.numpy()[slots[held]]
        rows[~held] = hashed_random_rows(keys[~held], self.dim)
        return slots, rows

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
        self._mark_dirty(slots)
        return slots

    def _mark_dirty(self, slots: np.ndarray) -> None:
        fresh = slots[~self.dirty[slots]]
        if fresh.size:
            self.dirty[fresh] = True
            self._dirty_slots.append(fresh)

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
        self._drop(candidates[np.argpartition(self.last_used[candidates], count - 1)[:count]])
        self.evictions += int(count)

    def expire(self, step: int, after_steps: int) -> int:
        """Evict the rows unused in the last ``after_steps`` steps before ``step`` (published as deletes); returns
        how many. One vectorised pass over the table: callers run it every fraction of ``after_steps``."""
        stale = np.flatnonzero(self.live[: self._high] & (self.last_used[: self._high] < step - after_steps))
        if stale.size:
            self._drop(stale.astype(np.int32))
            self.expired += int(stale.size)
        return int(stale.size)

    def _drop(self, victims: np.ndarray) -> None:
        keys = self.keys[victims]
        self.index.remove(keys)
        was_published = self.published[victims]
        if was_published.any():
            self._deletes.append(keys[was_published])
        self.live[victims] = False
        self.dirty[victims] = False  # a dirty-list entry of a dropped slot is skipped by take_changes
        self.published[victims] = False
        self._free.append(victims)

    # ---- training -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_gradients(self, slots: np.ndarray, grads: torch.Tensor) -> None:
        """One optimizer step for distinct ``slots`` with their (summed) gradients (n, dim) float32; slots < 0 (ids
        not admitted) are skipped."""
        held = slots >= 0
        if not held.all():
            slots, grads = slots[held], grads[torch.from_numpy(held)]
        if slots.size == 0:
            return
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        grads = grads.to(torch.float32)
        if self.optimizer == "adagrad":
            acc = self.accum.index_select(0, index) + grads.pow(2).mean(dim=1)
            self.accum.index_copy_(0, index, acc)
            grads = grads / (acc.sqrt() + self.eps).unsqueeze(1)
        self.weight.index_add_(0, index, grads, alpha=-self.lr)
        self._mark_dirty(slots)

    # ---- publishing -----------------------------------------------------------------------------------------
    def take_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys to delete, keys changed, their rows) since the last call; marks the changed rows published.

        A key evicted and created again since the last call is published, not deleted.
        """
        deletes = np.unique(np.concatenate(self._deletes)) if self._deletes else np.zeros(0, dtype=np.int64)
        self._deletes = []
        slots = np.concatenate(self._dirty_slots) if self._dirty_slots else np.zeros(0, dtype=np.int32)
        self._dirty_slots = []
        # entries of slots dropped since are stale; a slot dropped and reused has two entries
        slots = np.unique(slots[self.dirty[slots]])
        keys = self.keys[slots]
        if deletes.size and keys.size:
            deletes = deletes[~np.isin(deletes, keys)]
        rows = self.weight.numpy()[slots].copy()
        self.dirty[slots] = False
        self.published[slots] = True
        return deletes, keys, rows

    def mark_changed(self, keys: np.ndarray) -> np.ndarray:
        """Publish ``keys`` again at the next ``take_changes``: held rows as rows, the others as deletes (a resume
        covering what the interrupted run published after its checkpoint). Returns the held keys."""
        keys = np.unique(np.asarray(keys, dtype=np.int64))
        slots = self.index.find(keys)
        held = slots >= 0
        self._mark_dirty(slots[held])
        if (~held).any():
            self._deletes.append(keys[~held])
        return keys[held]

    def pending(self) -> int:
        return sum(int(s.size) for s in self._dirty_slots) + sum(int(d.size) for d in self._deletes)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state(self, unacknowledged: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The held rows and their state, as arrays (what a checkpoint stores). ``unacknowledged``: (keys, delete
        keys) handed to a publish the broker has not acknowledged yet: stored as still to publish."""
        slots = np.flatnonzero(self.live[: self._high])
        deletes = np.concatenate(self._deletes) if self._deletes else np.zeros(0, dtype=np.int64)
        keys, dirty = self.keys[slots].copy(), self.dirty[slots].copy()
        if unacknowledged is not None:
            dirty |= np.isin(keys, unacknowledged[0])
            deletes = np.concatenate([deletes, unacknowledged[1]])
        out = {
            "keys": keys, "rows": self.weight.numpy()[slots].copy(),
            "accum": self.accum.numpy()[slots].copy(), "last_used": self.last_used[slots].copy(),
            "published": self.published[slots].copy(), "dirty": dirty, "deletes": deletes,
        }
        if self.sketch is not None:
            out["sketch"] = self.sketch.counters.copy()
        return out

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
        self._mark_dirty(slots[np.asarray(state["dirty"], dtype=bool)])
        deletes = np.asarray(state.get("deletes", np.zeros(0)), dtype=np.int64)
        if deletes.size:
            self._deletes.append(deletes)
        if self.sketch is not None:
            for counters in state.get("sketches", ()):
                self.sketch.merge(np.asarray(counters, dtype=np.uint16))
