"""A plain-Python model of the set-associative LRU/LFU cache with row versions, slot by slot, for the property
tests."""

from __future__ import annotations

from dataclasses import dataclass

MASK64 = (1 << 64) - 1


def mix(key: int) -> int:
    """The splitmix64 finalizer of the key's 64 bits."""
    x = key & MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def set_of(key: int, sets: int) -> int:
    """High 32 hash bits scaled to [0, sets): the mapping the cache documents."""
    return ((mix(key) >> 32) * sets) >> 32


def tag_of(key: int) -> int:
    """0x80 | the low 7 hash bits: the slot tag the cache documents (never 0, the free state)."""
    return 0x80 | (mix(key) & 0x7F)


@dataclass
class Entry:
    key: int
    clock: int
    vector: tuple[float, ...]
    version: int = 0


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

    def insert(self, keys: list[int], vectors: list[tuple[float, ...]], versions: list[int] | None = None,
               evict: bool = True) -> tuple[int, int, int, int, int]:
        self.tick += 1
        versions = [0] * len(keys) if versions is None else versions
        chosen: dict[int, int] = {}
        for i, key in enumerate(keys):  # the highest version per key, the last among equals
            if key not in chosen or versions[i] >= versions[chosen[key]]:
                chosen[key] = i
        overwritten = stale = 0
        new_by_set: dict[int, list[int]] = {}
        for i in sorted(chosen.values()):
            entry = self._find(keys[i])
            if entry is None:
                new_by_set.setdefault(set_of(keys[i], self.sets), []).append(i)
            elif entry.version > versions[i]:
                stale += 1
            else:
                entry.vector, entry.version = vectors[i], versions[i]
                self._touch(entry)
                overwritten += 1
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
                row[way] = Entry(keys[i], new_clock, vectors[i], versions[i])
                placed += 1
        new_total = sum(len(v) for v in new_by_set.values())
        return overwritten + placed, placed, evicted, new_total - placed, stale

    def update(self, keys: list[int], vectors: list[tuple[float, ...]], versions: list[int] | None = None) -> int:
        versions = [0] * len(keys) if versions is None else versions
        written = set()
        for key, vector, version in zip(keys, vectors, versions):
            entry = self._find(key)
            if entry is not None and entry.version <= version:
                entry.vector, entry.version = vector, version
                written.add(key)
        return len(written)

    def invalidate(self, keys: list[int], versions: list[int] | None = None) -> int:
        removed = 0
        for i, key in enumerate(keys):
            row = self.slots[set_of(key, self.sets)]
            for way, entry in enumerate(row):
                if entry is not None and entry.key == key and (versions is None or entry.version <= versions[i]):
                    row[way] = None
                    removed += 1
        return removed

    def rows(self) -> int:
        return sum(e is not None for row in self.slots for e in row)
