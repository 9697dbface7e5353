"""A history of operations against hps-service and a checker of its consistency properties (issue 14).

In the manner of Jepsen's checkers: every operation is recorded with its start and its acknowledgement (monotonic
clock of the recording process), then per key:

1. no lookup returns a version older than one whose write was acknowledged before the lookup began (and a stored
   key is never answered with the default unless a delete could explain it), unless an admin delete may have come
   between them and the older put, still in flight then, landed after it;
2. no deleted key comes back after its delete was acknowledged, unless a newer put was acknowledged or in flight
   (or an admin delete, which forgets tombstones by design, let an older put that was still in flight land after it);
3. once writes stop and the updates are applied, L1, L2 and L3 agree on every key (checked from final reads by
   tier, see :func:`check_tiers_agree`).

Versions come from one counter, taken when a write starts, so a later write has a higher version. A versioned write
(a put, a Kafka tombstone, an import) takes effect by version; an admin delete (REST, no version) forgets the key at
its place in real time. The checker is sound, not complete: it flags only what no ordering consistent with the
acknowledgements allows. Rows encode (key, version) (:func:`encode_rows`), so every answer says which write it shows.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

DIM = 4
DEFAULT_VALUE = -1.0
#: Observed "version" of an answer: the table default, or a row that is not any write's row of that key.
DEFAULT, WRONG = -1, -2
_BITS23 = 1 << 23
INF = float("inf")

WriteKind = Literal["put", "delete", "admin_delete"]


def encode_rows(keys: np.ndarray, version: int) -> np.ndarray:
    """The row a write of ``version`` stores for each key: (key mod 2^23, version, a check, 1), exact in float32."""
    keys = np.asarray(keys, dtype=np.int64)
    if not 0 <= version < (1 << 24):
        raise ValueError(f"version {version} does not fit a float32 exactly")
    out = np.empty((keys.shape[0], DIM), np.float32)
    out[:, 0] = keys % _BITS23
    out[:, 1] = version
    out[:, 2] = (keys * 7 + version) % _BITS23
    out[:, 3] = 1.0
    return out


def decode_rows(keys: np.ndarray, rows: np.ndarray, sources: np.ndarray, default_source: int = 4) -> np.ndarray:
    """The version each answer shows: its write's version, DEFAULT for the table default, WRONG for anything else
    (another key's row, a torn row, a default answered from a tier, a row answered as the default)."""
    keys = np.asarray(keys, dtype=np.int64)
    version = rows[:, 1].astype(np.int64)
    is_default = (rows == DEFAULT_VALUE).all(axis=1)
    mine = ((rows[:, 0] == keys % _BITS23) & (rows[:, 2] == (keys * 7 + version) % _BITS23) & (rows[:, 3] == 1.0)
            & (version >= 0))
    out = np.full(keys.shape[0], WRONG, dtype=np.int64)
    out[mine & (sources != default_source)] = version[mine & (sources != default_source)]
    out[is_default & (sources == default_source)] = DEFAULT
    return out


@dataclass
class Write:
    kind: WriteKind
    keys: np.ndarray
    version: int | None  # None: an admin delete
    start: float
    via: str  # kafka, rest, import
    ack: float | None = None  # None: never acknowledged (failed or still in flight at the end)


@dataclass
class Read:
    keys: np.ndarray
    versions: np.ndarray  # per key: the version shown, DEFAULT or WRONG
    sources: np.ndarray
    start: float
    end: float
    via: str = "grpc"


@dataclass
class History:
    """Operations recorded by many threads."""

    writes: list[Write] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _version: int = 0

    def next_version(self) -> int:
        with self._lock:
            self._version += 1
            return self._version

    def add_write(self, w: Write) -> Write:
        with self._lock:
            self.writes.append(w)
        return w

    def add_read(self, r: Read) -> None:
        with self._lock:
            self.reads.append(r)

    def counts(self) -> dict[str, int]:
        """Operations and key observations recorded, by kind."""
        with self._lock:
            out: dict[str, int] = defaultdict(int)
            for w in self.writes:
                out[f"{w.via} {w.kind}s"] += 1
                out["acknowledged writes"] += w.ack is not None
            out["lookups"] = len(self.reads)
            out["keys read"] = sum(r.keys.shape[0] for r in self.reads)
            out["operations"] = len(self.writes) + len(self.reads)
            return dict(out)


@dataclass
class Violation:
    key: int
    rule: str
    detail: str
    at: float | None = None  # the start of the read that shows it


def _fmt(t: float, t0: float) -> str:
    return "-" if t is None or t == INF else f"{t - t0:.3f}"


def key_history(history: History, key: int, t0: float, limit: int | None = 60, at: float | None = None) -> str:
    """The writes and reads of one key in start order, for a violation report: the ``limit`` operations (None: all)
    up to a little after ``at`` (the violating read), else the last ``limit``."""
    lines = []
    for w in history.writes:
        if np.any(w.keys == key):
            lines.append((w.start, f"  {_fmt(w.start, t0):>9} .. {_fmt(w.ack or INF, t0):>9}  {w.via:6} {w.kind:12} "
                                   f"v{w.version if w.version is not None else '-'}"))
    for r in history.reads:
        hit = np.flatnonzero(r.keys == key)
        for i in hit:
            shown = {DEFAULT: "default", WRONG: "WRONG ROW"}.get(int(r.versions[i]), f"v{int(r.versions[i])}")
            lines.append((r.start, f"  {_fmt(r.start, t0):>9} .. {_fmt(r.end, t0):>9}  {r.via:6} read         "
                                   f"{shown} (source {int(r.sources[i])})"))
    lines.sort(key=lambda x: x[0])
    if at is not None:
        upto = sum(1 for t, _ in lines if t <= at) + 5
        lines = lines[:upto]
    shown = [text for _, text in (lines if limit is None else lines[-limit:])]
    skipped = len(lines) - len(shown)
    return "\n".join(([f"  ... {skipped} earlier operations"] if skipped else []) + shown)


def check(history: History) -> list[Violation]:
    """Properties 1 and 2 for every read of every key (see the module docstring)."""
    per_key_writes: dict[int, list[Write]] = defaultdict(list)
    for w in history.writes:
        for k in np.unique(w.keys).tolist():
            per_key_writes[k].append(w)
    per_key_reads: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for r in history.reads:
        for k, v in zip(r.keys.tolist(), r.versions.tolist(), strict=True):
            per_key_reads[k].append((r.start, r.end, v))
    violations: list[Violation] = []
    for key, reads in per_key_reads.items():
        violations.extend(_check_key(key, per_key_writes.get(key, []), reads))
    return violations


def _check_key(key: int, writes: list[Write], reads: list[tuple[float, float, int]]) -> list[Violation]:
    """Both properties for every read of one key, vectorised over reads x writes."""
    out: list[Violation] = []

    def arrays(ws: list[Write]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.array([w.start for w in ws], dtype=np.float64).reshape(-1),
                np.array([INF if w.ack is None else w.ack for w in ws], dtype=np.float64).reshape(-1),
                np.array([-1 if w.version is None else w.version for w in ws], dtype=np.int64).reshape(-1))

    p_start, p_ack, p_ver = arrays([w for w in writes if w.kind == "put"])
    d_start, d_ack, d_ver = arrays([w for w in writes if w.kind == "delete"])
    a_start, a_ack, _ = arrays([w for w in writes if w.kind == "admin_delete"])
    # the time from which each put is certainly cancelled by an admin delete (one that started after the put's ack)
    if a_start.size and p_ack.size:
        after = a_start[None, :] > p_ack[:, None]
        p_cancel = np.where(after, a_ack[None, :], INF).min(axis=1)
    else:
        p_cancel = np.full(p_ack.shape, INF)
    r_start = np.array([r[0] for r in reads], dtype=np.float64)
    r_end = np.array([r[1] for r in reads], dtype=np.float64)
    shown = np.array([r[2] for r in reads], dtype=np.int64)

    live = (p_ack[None, :] < r_start[:, None]) & (p_cancel[None, :] >= r_start[:, None])  # reads x puts
    need_idx = np.where(live, p_ver[None, :], -1).argmax(axis=1) if p_ver.size else np.zeros(len(reads), np.int64)
    has_need = live.any(axis=1) if p_ver.size else np.zeros(len(reads), bool)
    need_ver = np.where(has_need, p_ver[need_idx] if p_ver.size else -1, -1)
    need_start = np.where(has_need, p_start[need_idx] if p_ver.size else INF, INF)
    # deletes that may follow the needed put (explain a default answer)
    vdel_ok = ((d_start[None, :] < r_end[:, None]) & (d_ver[None, :] >= need_ver[:, None])).any(axis=1) \
        if d_ver.size else np.zeros(len(reads), bool)
    adel_ok = ((a_start[None, :] < r_end[:, None]) & (a_ack[None, :] >= need_start[:, None])).any(axis=1) \
        if a_start.size else np.zeros(len(reads), bool)
    # the newest versioned delete acknowledged before each read
    gone_ver = np.where(d_ack[None, :] < r_start[:, None], d_ver[None, :], -1).max(axis=1) \
        if d_ver.size else np.full(len(reads), -1)
    version_index = {int(v): i for i, v in enumerate(p_ver.tolist())}
    for i in range(len(reads)):
        v = int(shown[i])
        if v == WRONG:
            out.append(Violation(key, "wrong row", "the answer is neither a row written for this key nor the default",
                                 float(r_start[i])))
        elif v == DEFAULT:
            if has_need[i] and not vdel_ok[i] and not adel_ok[i]:
                out.append(Violation(key, "lost update", f"the default, although v{int(need_ver[i])} was acknowledged "
                                                         "before the lookup began and no delete can follow it",
                                     float(r_start[i])))
        else:
            j = version_index.get(v)
            if j is None or p_start[j] >= r_end[i]:
                out.append(Violation(key, "phantom", f"v{v}, which no put of this key had started", float(r_start[i])))
                continue
            if has_need[i] and v < need_ver[i] and not _older_put_after_admin_delete(
                    need_start[i], r_end[i], p_ack[j], a_start, a_ack):
                out.append(Violation(key, "stale read", f"v{v}, older than v{int(need_ver[i])}, acknowledged before "
                                                        "the lookup began", float(r_start[i])))
            if gone_ver[i] >= v and not _tombstones_forgotten(v, r_start[i], r_end[i], p_ack[j], d_start, d_ack,
                                                              d_ver, a_start, a_ack):
                out.append(Violation(key, "resurrected", f"v{v}, deleted at v{int(gone_ver[i])} (acknowledged before "
                                                         "the lookup began)", float(r_start[i])))
            if p_cancel[j] < r_start[i]:
                out.append(Violation(key, "resurrected", f"v{v}, removed by an admin delete acknowledged before the "
                                                         "lookup began", float(r_start[i])))
    return out


def _older_put_after_admin_delete(need_start: float, end: float, put_ack: float, a_start: np.ndarray,
                                  a_ack: np.ndarray) -> bool:
    """Whether an admin delete may have removed the newer put (it did not end before that put began) before the read
    ended, and the older put shown, not acknowledged when that delete began, landed after it: allowed."""
    return bool(((a_ack >= need_start) & (a_start < end) & (put_ack >= a_start)).any())


def _tombstones_forgotten(v: int, start: float, end: float, put_ack: float, d_start: np.ndarray, d_ack: np.ndarray,
                          d_ver: np.ndarray, a_start: np.ndarray, a_ack: np.ndarray) -> bool:
    """Whether an admin delete may have forgotten every tombstone at or above ``v`` acknowledged before the read
    (admin deletes forget rows and tombstones alike), after which the put of ``v``, not yet acknowledged when the
    admin delete began, may land again: by design, not a resurrection."""
    relevant = (d_ack < start) & (d_ver >= v)
    latest = float(d_start[relevant].max())
    return bool(((a_start < end) & (a_ack >= latest) & (put_ack >= a_start)).any())


def check_tiers_agree(keys: np.ndarray, shown_by_pass: dict[str, np.ndarray], stored: np.ndarray) -> list[Violation]:
    """Property 3: the version each final pass showed (L1 first; then with L1 cleared, L2) equals what L3 stores."""
    out = []
    for name, shown in shown_by_pass.items():
        for i in np.flatnonzero(shown != stored):
            out.append(Violation(int(keys[i]), "tiers disagree",
                                 f"{name} answered {int(shown[i])}, RocksDB holds {int(stored[i])} (-1: nothing)"))
    return out
