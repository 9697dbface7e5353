"""A model's lifecycle as operations of a history (issue 57): versions added, dropped, added again under the same
number and retired by ``keep_versions``, the table converted between formats, the model replaced, the label
``production`` switched, all while writers put and delete rows and readers look them up through gRPC (the workers),
``LocalClient`` (the mapped store) and REST (the owner).

Each *incarnation* of a version (one add, up to its drop) is a table of its own with a history of its own
(:class:`~tests.history.model.History`), its row versions counted from a base of its own, so every answer says which
incarnation it shows. The rules, per key read:

* a row of an incarnation whose drop was acknowledged before the read began is a violation (a dropped version's
  rows served again: stale caches, reused arrays or column families);
* otherwise the read is a read of that incarnation's history and :func:`~tests.history.model.check` applies (stale
  reads, lost updates, resurrections, other keys' rows);
* a default answer is checked against the incarnation live throughout the read, if one was;
* every row of one answer comes from one version, the one the answer names (gRPC and REST) or asked for.

Writes to a version and its drop or add never overlap (a lock), so a write lands in the incarnation it was made for;
reads, conversions, replaces and label switches overlap everything. Rows are small integers (see :func:`encode`),
exact in fp16 and bf16, so a table converted to either still shows which write it holds.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import numpy as np

from hps_service.local import LocalClient
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.history.labels import LabelRead, Switch, check_labels
from tests.history.model import DEFAULT, DEFAULT_VALUE, WRONG, History, Read, Violation, Write, check
from tests.history.server import TOKEN, HistoryServer

AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIM = 8
#: Version numbers the driver adds, drops and adds again (0 is the model as configured, always served).
NUMBERS = (1, 2, 3, 4, 5)
KEEP_VERSIONS = 3
#: Row versions each incarnation may use (encoded in three base-256 digits: at most 2^24 in all).
SPAN = 40_000
#: The formats a conversion cycles the model's table through (each holds the rows of :func:`encode` exactly).
STORAGES = ("fp16", "bf16", "fp32")
_FAILED = (httpx.HTTPError, grpc.RpcError, ConnectionError, TimeoutError, OSError)


def encode(keys: np.ndarray, version: int) -> np.ndarray:
    """A write's row for each key: the key's low two bytes, the version's three, a check, 1 and 3, each an integer
    below 256 (exact in fp16 and bf16)."""
    keys = np.asarray(keys, dtype=np.int64)
    out = np.empty((keys.shape[0], DIM), np.float32)
    out[:, 0], out[:, 1] = keys & 255, (keys >> 8) & 255
    out[:, 2], out[:, 3], out[:, 4] = version & 255, (version >> 8) & 255, (version >> 16) & 255
    out[:, 5] = (keys * 7 + version) % 251
    out[:, 6], out[:, 7] = 1.0, 3.0
    return out


def decode(keys: np.ndarray, rows: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """The version each answer shows (:func:`tests.history.model.decode_rows` for rows of :func:`encode`)."""
    keys = np.asarray(keys, dtype=np.int64)
    r = rows.astype(np.int64)
    version = r[:, 2] + 256 * r[:, 3] + 65536 * r[:, 4]
    mine = ((r[:, 0] == keys & 255) & (r[:, 1] == (keys >> 8) & 255) & (r[:, 5] == (keys * 7 + version) % 251)
            & (rows[:, 6] == 1.0) & (rows[:, 7] == 3.0) & (rows == rows.astype(np.int64)).all(axis=1))
    out = np.full(keys.shape[0], WRONG, dtype=np.int64)
    default = sources == 4
    out[mine & ~default] = version[mine & ~default]
    out[(rows == DEFAULT_VALUE).all(axis=1) & default] = DEFAULT
    return out


@dataclass
class Incarnation:
    """One add of a version number, up to its drop: a table of its own, its rows' versions from ``base``."""

    number: int
    base: int
    history: History
    added: float  # when its add was acknowledged
    drop_start: float | None = None
    dropped: float | None = None  # when its drop was acknowledged

    def owns(self, version: int) -> bool:
        return self.base < version <= self.base + SPAN


@dataclass
class Events:
    """What the driver went through."""

    adds: int = 0
    re_adds: int = 0
    drops: int = 0
    retired: int = 0
    conversions: int = 0
    replaces: int = 0
    switches: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class LifecycleWorkload:
    """Writers, readers (gRPC, LocalClient, REST) and the lifecycle driver against one ``hps serve``."""

    def __init__(self, server: HistoryServer, keys: np.ndarray, seed: int = 57) -> None:
        self.s = server
        self.keys = keys
        self.seed = seed
        self.model = server.model
        self.incarnations: list[Incarnation] = [Incarnation(0, 0, History(_version=0), 0.0)]
        self.live: dict[int, Incarnation] = {0: self.incarnations[0]}
        self.events = Events()
        self.switches: list[Switch] = []
        self.label_reads: list[LabelRead] = []
        self.violations: list[Violation] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.reads = 0
        #: Keys answered with the default: (version that answered, the read of them).
        self.defaults: list[tuple[int, Read]] = []
        #: Reads that failed: (via, version asked, start, end, why, NOT_FOUND?).
        self.failed: list[tuple[str, int, float, float, str, bool]] = []
        self._lock = threading.Lock()
        self._writes = threading.Condition()  # writes in flight per version number; the driver waits them out
        self._writing: dict[int, int] = {}
        self._held: set[int] = set()  # numbers the driver is adding or dropping: no write starts on them
        self._storage = 0

    # ---- threads ---------------------------------------------------------------------------------
    def threads(self) -> list[threading.Thread]:
        bodies = [(self._writer, 0), (self._writer, 1), (self._grpc_reader, 0), (self._grpc_reader, 1),
                  (self._local_reader, 0), (self._rest_reader, 0), (self._driver, 0), (self._converter, 0)]
        return [threading.Thread(target=self._guard(f, i), name=f"life-{f.__name__}-{i}", daemon=True)
                for f, i in bodies]

    def _guard(self, f: Any, i: int) -> Any:
        def run() -> None:
            try:
                f(i)
            except Exception as exc:  # noqa: BLE001  (recorded: every unexpected failure fails the check)
                self.errors.append(f"{f.__name__}-{i}: {type(exc).__name__}: {exc}")
                self.stop.set()
        return run

    def _pick(self, rng: random.Random, n: int) -> np.ndarray:
        return np.unique(self.keys[[rng.randrange(self.keys.shape[0]) for _ in range(n)]])

    # ---- writes ------------------------------------------------------------------------------------
    def _writer(self, i: int) -> None:
        rng = random.Random(self.seed + i)
        with httpx.Client(base_url=self.s.http, timeout=30, headers=AUTH) as http:
            while not self.stop.is_set():
                with self._writes:
                    choices = [n for n in self.live if n not in self._held]
                    if not choices:
                        self._writes.wait(0.05)
                        continue
                    number = rng.choice(choices)
                    inc = self.live[number]
                    self._writing[number] = self._writing.get(number, 0) + 1
                try:
                    self._write(http, rng, inc)
                finally:
                    with self._writes:
                        self._writing[number] -= 1
                        self._writes.notify_all()

    def _write(self, http: httpx.Client, rng: random.Random, inc: Incarnation) -> None:
        keys = self._pick(rng, rng.randint(1, 8))
        version = inc.history.next_version()
        delete = rng.random() < 0.15
        w = inc.history.add_write(Write("delete" if delete else "put", keys, version, time.monotonic(), "rest"))
        body: dict[str, Any] = {"keys": keys.tolist(), "version": version}
        if not delete:
            body["vectors"] = encode(keys, version).tolist()
        params = {"model_version": inc.number}  # 0 too: a write naming none would go where production points
        r = http.request("DELETE" if delete else "PUT", f"/v1/models/{self.model}/tables/t/embeddings",
                         params=params, json=body)
        if r.status_code == 200:
            w.ack = time.monotonic()
        else:
            self.errors.append(f"a write to version {inc.number} answered {r.status_code}: {r.text[:200]}")

    # ---- reads -------------------------------------------------------------------------------------
    def _asked(self, rng: random.Random) -> int:
        """A version number to name (-1: none, the label decides), mostly one served now."""
        with self._lock:
            live = list(self.live)
        return rng.choice([-1, -1, *live, *live, rng.choice(NUMBERS)])

    def _grpc_reader(self, i: int) -> None:
        rng = random.Random(self.seed + 10 + i)
        with grpc.insecure_channel(self.s.target) as channel:
            stub = pb_grpc.EmbeddingServiceStub(channel)
            while not self.stop.is_set():
                keys, asked = self._pick(rng, 16), self._asked(rng)
                request = pb.LookupRequest(model=self.model, tables=[
                    pb.TableKeys(table="t", keys=keys.astype("<i8").tobytes())])
                if asked >= 0:
                    request.version = asked
                start = time.monotonic()
                try:
                    r = stub.Lookup(request, timeout=30)
                except grpc.RpcError as exc:
                    self._failed("grpc", asked, start, f"{exc.code().name}: {exc.details()}",
                                 exc.code() == grpc.StatusCode.NOT_FOUND)
                    continue
                tv = r.tables[0]
                rows = np.frombuffer(tv.vectors, dtype="<f4").reshape(keys.shape[0], DIM)
                self._record("grpc", keys, rows, np.frombuffer(tv.sources, np.uint8), asked, r.version, start)

    def _local_reader(self, i: int) -> None:
        rng = random.Random(self.seed + 20 + i)
        with LocalClient(self.s.local_path, timeout=30) as client:
            while not self.stop.is_set():
                keys, asked = self._pick(rng, 16), self._asked(rng)
                start = time.monotonic()
                try:
                    answer = client.lookup_with_sources(self.model, "t", keys,
                                                        **({"version": asked} if asked >= 0 else {}))
                except Exception as exc:  # noqa: BLE001  (judged by _failed)
                    self._failed("local", asked, start, f"{type(exc).__name__}: {exc}",
                                 "no version" in str(exc))
                    continue
                self._record("local", keys, answer.vectors, answer.sources, asked, None, start)

    def _rest_reader(self, i: int) -> None:
        rng = random.Random(self.seed + 30 + i)
        with httpx.Client(base_url=self.s.http, timeout=30) as http:
            while not self.stop.is_set():
                keys, asked = self._pick(rng, 16), self._asked(rng)
                params: dict[str, Any] = {"keys": ",".join(map(str, keys.tolist()))}
                if asked >= 0:
                    params["model_version"] = asked
                start = time.monotonic()
                r = http.get(f"/v1/models/{self.model}/tables/t/embeddings", params=params)
                if r.status_code != 200:
                    self._failed("rest", asked, start, r.text[:200], r.status_code == 404)
                    continue
                body = r.json()
                sources = np.array([_SOURCES[s] for s in body["sources"]], dtype=np.uint8)
                self._record("rest", keys, np.asarray(body["vectors"], np.float32), sources, asked,
                             int(body["version"]), start)

    def _failed(self, via: str, asked: int, start: float, why: str, not_found: bool) -> None:
        """A read that failed: judged at the end (a retirement by keep_versions is known once its add returns)."""
        with self._lock:
            self.failed.append((via, asked, start, time.monotonic(), why, not_found))

    def _record(self, via: str, keys: np.ndarray, rows: np.ndarray, sources: np.ndarray, asked: int,
                answered: int | None, start: float) -> None:
        """Route one answer's keys to the incarnations their rows belong to, and check what only the lifecycle can
        tell (a dropped incarnation's rows, rows of two versions, another version than the one asked)."""
        end = time.monotonic()
        shown = decode(keys, rows, sources)
        with self._lock:
            self.reads += 1
            owners = [self._owner(int(v)) if v >= 0 else None for v in shown.tolist()]
        numbers = {o.number for o in owners if o is not None}
        if answered is None:
            answered = asked if asked >= 0 else (numbers.pop() if len(numbers) == 1 else None)
            numbers = {answered} if answered is not None else numbers
        if len(numbers - {answered}) or (asked >= 0 and answered != asked):
            self.violations.append(Violation(int(keys[0]), "versions mixed", f"{via}: asked {asked}, answered "
                                             f"{answered}, rows of versions {sorted(numbers)}", start))
            return
        if asked < 0 and answered is not None:
            with self._lock:
                self.label_reads.append(LabelRead(-1, answered, start, end))
        for inc in {id(o): o for o in owners if o is not None}.values():
            if inc.dropped is not None and inc.dropped < start:
                self.violations.append(Violation(int(keys[0]), "dropped version served", f"{via}: rows of version "
                                                 f"{inc.number} as added at {inc.added:.3f}, whose drop was "
                                                 f"acknowledged at {inc.dropped:.3f}", start))
            mine = np.array([o is inc for o in owners])
            inc.history.add_read(Read(keys[mine], shown[mine], sources[mine], start, end, via))
        defaults = shown == DEFAULT
        if defaults.any() and answered is not None:  # routed at the end, when every retirement is known
            with self._lock:
                self.defaults.append((answered, Read(keys[defaults], shown[defaults], sources[defaults], start, end,
                                                     via)))
        wrong = shown == WRONG
        if wrong.any():
            self.violations.append(Violation(int(keys[wrong][0]), "wrong row", f"{via}: {int(wrong.sum())} rows of "
                                             "no write of their key", start))

    def _owner(self, version: int) -> Incarnation | None:
        return next((inc for inc in self.incarnations if inc.owns(version)), None)

    def _live_throughout(self, number: int, start: float, end: float) -> Incarnation | None:
        with self._lock:
            return next((inc for inc in self.incarnations if inc.number == number and inc.added < start
                         and (inc.drop_start is None or inc.drop_start > end)), None)

    # ---- the lifecycle -------------------------------------------------------------------------------
    def _hold(self, numbers: set[int]) -> None:
        """Keep new writes off ``numbers`` and wait out those in flight (a write lands in its own incarnation)."""
        with self._writes:
            self._held |= numbers
            self._writes.wait_for(lambda: not any(self._writing.get(n, 0) for n in numbers), timeout=60)

    def _release(self) -> None:
        with self._writes:
            self._held.clear()
            self._writes.notify_all()

    def _driver(self, i: int) -> None:
        rng = random.Random(self.seed + 40 + i)
        with httpx.Client(base_url=self.s.http, timeout=120, headers=AUTH) as http:
            while not self.stop.wait(0.15 + 0.2 * rng.random()):
                step = rng.random()
                if step < 0.4:
                    self._add(http, rng)
                elif step < 0.6:
                    self._drop(http, rng)
                elif step < 0.85:
                    self._switch(http, rng)
                else:
                    self._replace(http)

    def _refused(self, what: str, r: httpx.Response) -> None:
        key = f"{what} {r.status_code}"
        self.events.refused[key] = self.events.refused.get(key, 0) + 1
        if r.status_code not in (409, 503):
            self.errors.append(f"{what} answered {r.status_code}: {r.text[:200]}")

    def _add(self, http: httpx.Client, rng: random.Random) -> None:
        """Add a version number not served now: a new incarnation (retention may retire the oldest unlabelled)."""
        free = [n for n in NUMBERS if n not in self.live]
        if not free:
            return
        number = rng.choice(free)
        self._hold(set(NUMBERS))
        try:
            started = time.monotonic()
            r = http.post(f"/v1/models/{self.model}/versions", json={"version": number})
            if r.status_code != 201:
                return self._refused("add", r)
            now = time.monotonic()
            served = {v["version"] for v in r.json()["versions"]}
            with self._lock:
                again = any(inc.number == number for inc in self.incarnations)
                base = len(self.incarnations) * SPAN
                inc = Incarnation(number, base, History(_version=base), now)
                self.incarnations.append(inc)
                self.live[number] = inc
                for n in [n for n in self.live if n and n not in served]:  # retired by keep_versions
                    gone = self.live.pop(n)
                    gone.drop_start, gone.dropped = started, now
                    self.events.retired += 1
            self.events.adds += 1
            self.events.re_adds += again
        finally:
            self._release()

    def _drop(self, http: httpx.Client, rng: random.Random) -> None:
        choices = [n for n in self.live if n]
        if not choices:
            return
        number = rng.choice(choices)
        self._hold({number})
        try:
            inc = self.live[number]
            inc.drop_start = time.monotonic()
            r = http.delete(f"/v1/models/{self.model}/versions/{number}")
            if r.status_code != 200:
                inc.drop_start = None
                return self._refused("drop", r)  # labelled: the label moves first
            with self._lock:
                inc.dropped = time.monotonic()
                del self.live[number]
            self.events.drops += 1
        finally:
            self._release()

    def _switch(self, http: httpx.Client, rng: random.Random) -> None:
        with self._lock:
            target = rng.choice(list(self.live))
        s = Switch(target, time.monotonic())
        self.switches.append(s)
        r = http.put(f"/v1/models/{self.model}/labels/production", json={"version": target, "allow_empty": True})
        if r.status_code != 200:
            return self._refused("switch", r)
        s.ack = time.monotonic()
        self.events.switches += 1

    def _replace(self, http: httpx.Client) -> None:
        model = {"name": self.model, "keep_versions": KEEP_VERSIONS,
                 "tables": [{"name": "t", "dim": DIM, "default": {"constant": DEFAULT_VALUE}}]}
        r = http.post("/v1/models", params={"replace": "true"}, json=model)
        if r.status_code != 201:
            return self._refused("replace", r)
        self.events.replaces += 1

    def _converter(self, i: int) -> None:
        """Convert the model's table through fp16, bf16 and back to fp32, one job after another."""
        with httpx.Client(base_url=self.s.http, timeout=60, headers=AUTH) as http:
            while not self.stop.wait(1.0):
                storage = STORAGES[self._storage % len(STORAGES)]
                r = http.post(f"/v1/models/{self.model}/tables/t:convert", json={"storage": storage})
                if r.status_code != 202:
                    self._refused("convert", r)
                    continue
                job = r.json()["id"]
                while (view := http.get(f"/v1/jobs/{job}").json())["state"] not in ("succeeded", "failed"):
                    if self.stop.wait(0.1):
                        return
                if view["state"] != "succeeded":
                    if "registered again during its conversion" in str(view.get("error")):
                        key = "convert aborted by a replace"  # the documented refusal: the copy's source was replaced
                        self.events.refused[key] = self.events.refused.get(key, 0) + 1
                        continue
                    self.errors.append(f"conversion to {storage} failed: {view.get('error')}")
                    return
                self._storage += 1
                self.events.conversions += 1

    # ---- the verdict -------------------------------------------------------------------------------
    def check(self) -> list[tuple[Incarnation | None, Violation]]:
        """Every rule of the module docstring, over everything recorded: each violation with the incarnation whose
        history shows it (None: a rule across incarnations)."""
        out: list[tuple[Incarnation | None, Violation]] = [(None, v) for v in self.violations]
        for number, read in self.defaults:  # a default is checked against the incarnation live throughout its read
            if (owner := self._live_throughout(number, read.start, read.end)) is not None:
                owner.history.add_read(read)
        self.defaults.clear()
        for inc in self.incarnations:
            out.extend((inc, v) for v in check(inc.history))
        out.extend((None, Violation(-1, "label", text)) for text in check_labels(self.switches, self.label_reads))
        for via, asked, start, end, why, not_found in self.failed:  # only NOT_FOUND of a version not served throughout
            if not (not_found and asked > 0 and self._live_throughout(asked, start, end) is None):
                out.append((None, Violation(-1, "failed read", f"{via} read of version {asked}: {why}", start)))
        return out

    def counts(self) -> dict[str, int]:
        writes = sum(len(inc.history.writes) for inc in self.incarnations)
        acked = sum(w.ack is not None for inc in self.incarnations for w in inc.history.writes)
        keys = sum(r.keys.shape[0] for inc in self.incarnations for r in inc.history.reads)
        return {"operations": writes + self.reads, "writes": writes, "acknowledged writes": acked,
                "lookups": self.reads, "keys checked": keys, "incarnations": len(self.incarnations)}


_SOURCES = {"cache": 1, "volatile": 2, "persistent": 3, "default": 4, "expired": 5}
