"""A plain-Python model of the set-associative LRU/LFU cache, slot by slot, for the property tests."""

from __future__ import annotations

from dataclasses import dataclass

MASK64 = (1 << 64) - 1


def set_of(key: int, sets: int) -> int:
    """splitmix64 finalizer, high 32 bits scaled to [0, sets): the mapping the cache documents."""
    x = key & MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return ((x >> 32) * sets) >> 32


@dataclass
class Entry:
    key: int
    clock: int
    vector: tuple[float, ...]


class CacheModel:
    """Slots[set][way] is None or an Entry; the rules are the ones in set_assoc's module docstring."""

    def __init__(self, sets: int, ways: int, policy: str) -> None:
        self.sets, self.ways, self.policy = sets, ways, policy
        self.slots: list[list[Entry | None]] = [[None] * ways for _ in range(sets)]
        self.tick = 0

    def _find(self, key: int) -> Entry | None:
        return next((e for e in self.slots[set_of(key, self.sets)] if e is not None and e.key == key), None)

    def _touch(self, entry: Entry) -> None:
        entry.clock = self.tick if self.policy == "lru" else entry.clock + 1

    def query(self, keys: list[int]) -> list[tuple[float, ...] | None]:
        self.tick += 1
        answers = []
        for key in keys:
            entry = self._find(key)
            if entry is not None:
                self._touch(entry)
            answers.append(None if entry is None else entry.vector)
        return answers

    def insert(self, keys: list[int], vectors: list[tuple[float, ...]], evict: bool = True) -> tuple[int, int, int, int]:
        self.tick += 1
        last = {key: i for i, key in enumerate(keys)}
        overwritten = 0
        new_by_set: dict[int, list[int]] = {}
        for i in sorted(last.values()):
            entry = self._find(keys[i])
            if entry is not None:
                entry.vector = vectors[i]
                self._touch(entry)
                overwritten += 1
            else:
                new_by_set.setdefault(set_of(keys[i], self.sets), []).append(i)
        placed = evicted = 0
        new_clock = self.tick if self.policy == "lru" else 1
        for s, idxs in new_by_set.items():
            row = self.slots[s]
            order = sorted(range(self.ways), key=lambda w: (-1, w) if row[w] is None else (row[w].clock, w))
            for rank, i in enumerate(idxs[: self.ways]):
                way = order[rank]
                if row[way] is not None:
                    if not evict:
                        break
                    evicted += 1
                row[way] = Entry(keys[i], new_clock, vectors[i])
                placed += 1
        new_total = sum(len(v) for v in new_by_set.values())
        return overwritten + placed, placed, evicted, new_total - placed

    def update(self, keys: list[int], vectors: list[tuple[float, ...]]) -> int:
        cached = set()
        for key, vector in zip(keys, vectors):
            entry = self._find(key)
            if entry is not None:
                entry.vector = vector
                cached.add(key)
        return len(cached)

    def invalidate(self, keys: list[int]) -> int:
        removed = 0
        for key in keys:
            row = self.slots[set_of(key, self.sets)]
            for way, entry in enumerate(row):
                if entry is not None and entry.key == key:
                    row[way] = None
                    removed += 1
        return removed
