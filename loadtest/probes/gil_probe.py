"""Which RocksDB calls of the update path hold the GIL (and so stall every lookup thread while they run)?

    python -m loadtest.probes.gil_probe

For each call, another Python thread is made runnable just before the call starts and records when it got the GIL.
If the call released the GIL, that thread runs at once (in the first half of the call); if the call held it
throughout, the thread runs only when the call returns. Counted over 30 calls each, beside ``time.sleep`` (which
releases the GIL) as the control. The classification does not depend on how fast this machine is, only on whether
the other thread can run at all during the call.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from pathlib import Path

import numpy as np
from rocksdict import WriteBatch, WriteOptions

from hps_service.tiers.codec import encode_keys, encode_rows
from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

TABLE = "m.t"


def _record_when_running(go: threading.Event, seen: list[float]) -> None:
    go.wait()
    seen.append(time.perf_counter())


def probe(prepare: Callable[[], object], call: Callable[[object], object], n: int) -> tuple[int, float]:
    """(calls during whose first half another thread got the GIL, median call time in ms)."""
    ran, durations = 0, []
    for _ in range(n):
        arg = prepare()
        go = threading.Event()
        seen: list[float] = []
        other = threading.Thread(target=_record_when_running, args=(go, seen))
        other.start()
        time.sleep(0.005)
        go.set()  # runnable now; it needs the GIL to record the time
        t0 = time.perf_counter()
        call(arg)
        t1 = time.perf_counter()
        other.join()
        ran += seen[0] < t0 + 0.5 * (t1 - t0)
        durations.append(t1 - t0)
    return ran, float(np.median(durations)) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=200_000, help="rows in the store")
    ap.add_argument("--batch", type=int, default=1000, help="rows per write batch or multi-get")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hps-gil-probe-"))
    tier = RocksDBTier(tmp, block_cache_mb=64, sync_writes=False)
    try:
        tier.create_table(TABLE, 64)
        rng = np.random.default_rng(0)
        tier.bulk_import(TABLE, np.arange(args.rows, dtype=np.int64),
                         rng.standard_normal((args.rows, 64), dtype=np.float32))
        db, cf, handle = tier._db, tier._cfs[TABLE], tier._handles[TABLE]

        def batch() -> WriteBatch:
            b = WriteBatch(raw_mode=True)
            keys = encode_keys(rng.integers(0, args.rows, args.batch))
            rows = encode_rows(rng.standard_normal((args.batch, 64), dtype=np.float32), np.ones(args.batch, np.int64))
            deque(map(b.put, keys, rows, repeat(handle)), maxlen=0)
            return b

        synced, unsynced = WriteOptions(), WriteOptions()
        synced.sync, unsynced.sync = True, False
        cases: list[tuple[str, Callable[[], object], Callable[[object], object]]] = [
            ("write(batch, sync=True)", batch, lambda b: db.write(b, synced)),
            ("write(batch, sync=False)", batch, lambda b: db.write(b, unsynced)),
            ("flush_wal(True) after an unsynced write", lambda: db.write(batch(), unsynced),
             lambda _: db.flush_wal(True)),
            (f"multi-get of {args.batch} keys", lambda: encode_keys(rng.integers(0, args.rows, args.batch)),
             lambda keys: cf.get(keys)),
            ("time.sleep(0.01) (releases the GIL: the control)", lambda: None, lambda _: time.sleep(0.01)),
        ]
        for label, prepare, call in cases:
            ran, ms = probe(prepare, call, args.calls)
            verdict = "releases the GIL" if ran > args.calls // 2 else "holds the GIL" if ran == 0 else "partly"
            print(f"{label:50s} another thread ran during {ran:2d}/{args.calls} calls (median {ms:5.1f} ms): {verdict}")
    finally:
        tier.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
