"""Label switches as operations of a history (issue 30): a workload against ``hps serve`` that writes to two versions
of a model, switches the label ``production`` between them, and reads with and without naming a version; and the
rules it is checked by.

Each version has a history of its own (:class:`~tests.history.model.History`, its versions counted from a base of
its own so that no row of one passes for a row of the other), checked by :func:`tests.history.model.check`: a
read answered by version v is a read of v's history. The label rule, per read that names no version: it is
answered by the version of the last switch acknowledged before it began (the model as configured before any), or
by one of the switches in flight during it (started before it ended and not yet superseded by a switch acknowledged
before it began). A read that names a version is answered by that version.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import grpc
import httpx
import numpy as np

from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.history.model import History, Read, Write, decode_rows, encode_rows
from tests.history.server import TOKEN, HistoryServer

AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: The versions of the model the workload serves (0: the model as configured), and where each one's row
#: versions start.
VERSIONS = {0: 0, 1: 1_000_000}
_DOWN = (httpx.HTTPError, grpc.RpcError, ConnectionError, TimeoutError, OSError)


@dataclass
class Switch:
    """One PUT of the label ``production``: its target, when it started and when it was acknowledged (None: never)."""

    target: int
    start: float
    ack: float | None = None


@dataclass
class LabelRead:
    """A lookup that named version ``asked`` (-1: none, the label decides) and the version that answered."""

    asked: int
    answered: int
    start: float
    end: float


def check_labels(switches: list[Switch], reads: list[LabelRead], initial: int = 0) -> list[str]:
    """The label rule (see the module docstring) for every read; one line per violation."""
    out = []
    acked = sorted((s for s in switches if s.ack is not None), key=lambda s: s.ack or 0.0)
    for r in reads:
        if r.asked >= 0:
            if r.answered != r.asked:
                out.append(f"a read of version {r.asked} answered by version {r.answered} at {r.start:.3f}")
            continue
        before = [s for s in acked if s.ack is not None and s.ack < r.start]
        last = before[-1] if before else None
        allowed = {last.target if last is not None else initial}
        allowed |= {s.target for s in switches if s.start < r.end and (s.ack is None or s.ack >= r.start)
                    and (last is None or s.start > last.start)}
        if r.answered not in allowed:
            out.append(f"a read at {r.start:.3f}-{r.end:.3f} answered by version {r.answered}, not one of "
                       f"{sorted(allowed)} that the switches allow")
    return out


class LabelWorkload:
    """Writers to both versions (REST puts and versioned deletes, acknowledged once applied), readers over gRPC
    (half naming no version), and a labeler switching ``production`` back and forth."""

    def __init__(self, server: HistoryServer, keys: np.ndarray, seed: int = 5) -> None:
        self.server = server
        self.keys = keys
        self.seed = seed
        self.histories = {v: History(_version=base) for v, base in VERSIONS.items()}
        self.switches: list[Switch] = []
        self.reads: list[LabelRead] = []
        self.errors: list[str] = []
        #: Answers other than 200, by kind and status (writes and switches refused while a server starts).
        self.refusals: dict[str, int] = {}
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def threads(self) -> list[threading.Thread]:
        return [threading.Thread(target=self._guard(f), args=(i,), name=f"label-{f.__name__}-{i}", daemon=True)
                for f, n in ((self._writer, 2), (self._reader, 2), (self._labeler, 1)) for i in range(n)]

    def _guard(self, f):  # noqa: ANN001, ANN202  (a thread body: an unexpected error is recorded, not lost)
        def run(i: int) -> None:
            try:
                f(i)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"{f.__name__}: {type(exc).__name__}: {exc}")
        return run

    def _writer(self, i: int) -> None:
        rng = random.Random(self.seed + i)
        with httpx.Client(base_url=self.server.http, timeout=30, headers=AUTH) as http:
            while not self.stop.is_set():
                model_version = rng.choice(list(VERSIONS))
                history = self.histories[model_version]
                keys = np.array(rng.sample(list(self.keys), rng.randint(1, 8)), dtype=np.int64)
                version = history.next_version()
                delete = rng.random() < 0.15
                w = history.add_write(Write("delete" if delete else "put", keys, version, time.monotonic(), "rest"))
                body = {"keys": keys.tolist(), "version": version}
                if not delete:
                    body["vectors"] = encode_rows(keys, version).tolist()
                try:
                    r = http.request("DELETE" if delete else "PUT", "/v1/models/hist/tables/t/embeddings",
                                     params={"model_version": model_version, "wait": "applied"}, json=body)
                except _DOWN:
                    self.stop.wait(0.05)
                    continue
                if r.status_code == 200:
                    w.ack = time.monotonic()
                else:
                    self.stop.wait(0.05)  # the server is starting: no busy loop of refusals
                what = f"write {r.status_code}" + (f": {r.text[:160]}" if r.status_code == 404 else "")
                self.refusals[what] = self.refusals.get(what, 0) + 1

    def _reader(self, i: int) -> None:
        rng = np.random.default_rng(self.seed + 10 + i)
        while not self.stop.is_set():
            try:
                with grpc.insecure_channel(self.server.target) as channel:
                    stub = pb_grpc.EmbeddingServiceStub(channel)
                    while not self.stop.is_set():
                        self._read(stub, rng)
            except _DOWN:
                time.sleep(0.2)

    def _read(self, stub: pb_grpc.EmbeddingServiceStub, rng: np.random.Generator) -> None:
        keys = rng.choice(self.keys, 24)
        asked = int(rng.choice([-1, -1, *VERSIONS]))  # -1: none named, the label decides
        request = pb.LookupRequest(model="hist", tables=[pb.TableKeys(table="t", keys=keys.astype("<i8").tobytes())])
        if asked >= 0:
            request.version = asked  # 0 named explicitly: the model as configured
        start = time.monotonic()
        response = stub.Lookup(request, timeout=10)
        end = time.monotonic()
        tv = response.tables[0]
        rows = np.frombuffer(tv.vectors, dtype="<f4").reshape(len(keys), -1)
        sources = np.frombuffer(tv.sources, dtype=np.uint8)
        with self._lock:
            self.reads.append(LabelRead(asked, response.version, start, end))
        history = self.histories.get(response.version)
        if history is None:
            self.errors.append(f"an answer from version {response.version}, which the workload never made")
            return
        history.add_read(Read(keys, decode_rows(keys, rows, sources), sources, start, end))

    def _labeler(self, i: int) -> None:
        target = 0
        with httpx.Client(base_url=self.server.http, timeout=30, headers=AUTH) as http:
            while not self.stop.wait(0.3):
                target = 1 - target
                s = Switch(target, time.monotonic())
                with self._lock:
                    self.switches.append(s)
                try:
                    r = http.put("/v1/models/hist/labels/production", json={"version": target, "allow_empty": True})
                except _DOWN:
                    continue
                what = f"switch {r.status_code}" + (f": {r.json().get('detail', '')[:200]}" if r.status_code != 200 else "")
                self.refusals[what] = self.refusals.get(what, 0) + 1
                if r.status_code == 200:
                    s.ack = time.monotonic()
                elif r.status_code not in (409, 503):  # not switchable yet (a version preloading), or starting
                    self.errors.append(f"PUT label answered {r.status_code}: {r.text[:200]}")
