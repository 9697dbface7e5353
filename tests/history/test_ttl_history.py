"""Row expiry in the history checker (issue 30): ``hps serve`` (two workers, the edges' configuration) serves a table
with ``ttl_s: 2`` while a writer keeps some keys fresh and lets others age out, and readers look them up over gRPC.

Write times are the wall clock (the server stamps a REST put with its own clock as it publishes it, between the
put's start and its acknowledgement), so the rules are in wall-clock seconds. Per read of a key:

1. a row is never shown once it is certainly older than the TTL: its put was acknowledged more than
   ``ttl_s + 1`` s (the stamps' whole seconds) before the read began;
2. a key is never answered expired (or with the default) while it is certainly younger: a put of it started less
   than ``ttl_s`` s before the read ended, and was acknowledged before the read began;
3. an answer is never older than a put acknowledged before the read began (unless rule 1 let it expire), never
   another key's row, never a write that had not started.
"""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.history.labels import AUTH
from tests.history.model import DEFAULT, WRONG, decode_rows, encode_rows
from tests.history.server import HistoryServer
from tests.history.workload import key_space

TTL_S, SECONDS, EXPIRED = 2, 12.0, 5


class TTLServer(HistoryServer):
    """The history server with ``ttl_s`` on its table. Started on an update topic of its own (``topic_prefix``): the
    session's broker keeps the topic of model ``hist`` that the label history check wrote, and a server following it
    applies that check's rows first (older write times, higher versions than this check's first puts), which it
    rightly answers EXPIRED while this check counts its own puts of those keys as the newest (CI, 2026-12-04)."""

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["models"][0]["tables"][0]["ttl_s"] = TTL_S
        return cfg


def _check(puts: dict[int, list[tuple[int, float, float | None]]],
           reads: list[tuple[int, int, int, float, float]]) -> list[str]:
    """The three rules for every read ``(key, shown version or DEFAULT/WRONG, source, start, end)``; ``puts`` per
    key: ``(version, start, ack or None)``."""
    out = []
    for key, shown, source, start, end in reads:
        mine = puts.get(key, [])
        acked = [(v, s, a) for v, s, a in mine if a is not None and a < start]
        newest = max(acked, default=None)
        newest_ack = newest[2] if newest is not None and newest[2] is not None else float("inf")
        if shown == WRONG:
            out.append(f"key {key}: a row that is no write of it (source {source}) at {start:.3f}")
        elif shown == DEFAULT or source == EXPIRED:
            if newest is not None and end - newest[1] < TTL_S:
                out.append(f"key {key}: {'expired' if source == EXPIRED else 'the default'} at {start:.3f}-{end:.3f}"
                           f", though v{newest[0]}, started {newest[1]:.3f}, is younger than {TTL_S} s")
        else:
            put = next(((v, s, a) for v, s, a in mine if v == shown), None)
            if put is None or put[1] >= end:
                out.append(f"key {key}: v{shown}, which no put of it had started, at {start:.3f}")
            elif put[2] is not None and start > put[2] + TTL_S + 1:
                out.append(f"key {key}: v{shown} at {start:.3f}, acknowledged at {put[2]:.3f}: older than the TTL")
            elif newest is not None and shown < newest[0] and start <= newest_ack + TTL_S + 1:
                out.append(f"key {key}: v{shown} at {start:.3f}, older than v{newest[0]} acknowledged before")
    return out


def _timeline(violation: str, puts: dict[int, list[tuple[int, float, float | None]]],
               reads: list[tuple[int, int, int, float, float]]) -> list[str]:
    """The puts and reads of a violation's key from 3 s before it to 0.5 s after, in time order: what a failure
    report shows, so that one in CI says which answers and writes came around it."""
    key = int(violation.split(":")[0].split()[1])
    at = float(re.findall(r" at (\d+\.\d+)", violation)[0])
    events = [(s, f"put v{v} started, acknowledged {'never' if a is None else f'{a:.3f}'}")
              for v, s, a in puts.get(key, [])]
    events += [(s, f"read to {e:.3f}: shown {shown}, source {source}") for k, shown, source, s, e in reads if k == key]
    return [f"key {key} {t:.3f} {what}" for t, what in sorted(events) if at - 3 <= t <= at + 0.5]


@pytest.mark.timeout(SECONDS + 300)
def test_rows_expire_by_their_write_time_and_never_early(kafka_broker, tmp_path: Path) -> None:
    server = TTLServer(tmp_path, kafka_broker.bootstrap, topic_prefix=f"ttl-{uuid.uuid4().hex[:10]}")
    server.start()
    keys = key_space(48)
    fresh, aging = keys[:24], keys[24:]  # written all through; written in the first second only
    puts: dict[int, list[tuple[int, float, float | None]]] = {}
    reads: list[tuple[int, int, int, float, float]] = []
    lock = threading.Lock()
    counter = iter(range(1, 1 << 22))
    stop = threading.Event()
    errors: list[str] = []
    began = time.time()

    def writer() -> None:
        rng = random.Random(3)
        with httpx.Client(base_url=server.http, timeout=30, headers=AUTH) as http:
            while not stop.is_set():
                pool = aging if time.time() - began < 1.0 and rng.random() < 0.5 else fresh
                chosen = np.array(rng.sample(list(pool), 4), dtype=np.int64)
                with lock:
                    version = next(counter)
                    record = [(version, time.time(), None)]
                    for k in chosen.tolist():
                        puts.setdefault(k, []).append(record[0])
                r = http.put("/v1/models/hist/tables/t/embeddings", params={"wait": "applied"},
                             json={"keys": chosen.tolist(), "vectors": encode_rows(chosen, version).tolist(),
                                   "version": version})
                if r.status_code != 200:
                    errors.append(f"put answered {r.status_code}: {r.text[:200]}")
                    continue
                acked = time.time()
                with lock:
                    for k in chosen.tolist():
                        puts[k] = [(v, s, acked if v == version else a) for v, s, a in puts[k]]
                stop.wait(0.02)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.EmbeddingServiceStub(channel)
            while not stop.is_set():
                ask = rng.choice(keys, 16)
                start = time.time()
                r = stub.Lookup(pb.LookupRequest(model="hist", tables=[
                    pb.TableKeys(table="t", keys=ask.astype("<i8").tobytes())]), timeout=10)
                end = time.time()
                tv = r.tables[0]
                rows = np.frombuffer(tv.vectors, dtype="<f4").reshape(len(ask), -1)
                sources = np.frombuffer(tv.sources, dtype=np.uint8)
                shown = decode_rows(ask, rows, np.where(sources == EXPIRED, 4, sources).astype(np.uint8))
                with lock:
                    reads.extend(zip(ask.tolist(), shown.tolist(), sources.tolist(), [start] * len(ask),
                                     [end] * len(ask)))

    threads = [threading.Thread(target=writer), *(threading.Thread(target=reader, args=(i,)) for i in range(2))]
    try:
        for th in threads:
            th.start()
        time.sleep(SECONDS)
    finally:
        stop.set()
        for th in threads:
            th.join(60)
        assert server.stop() == 0, server.log_path.read_text()[-4000:]
    assert not errors, errors[:5]
    with lock:
        violations = _check(puts, reads)
    expired = sum(1 for _, _, source, _, _ in reads if source == EXPIRED)
    print(f"{len(reads)} key reads, {expired} answered expired, {sum(len(p) for p in puts.values())} key writes")
    if violations:
        print(*_timeline(violations[0], puts, reads), sep="\n")
    assert not violations, violations[:5]
    assert expired > 0, "no read saw a row expire"
