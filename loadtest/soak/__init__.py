"""Soak: mixed lookups and sustained Kafka updates against a real `hps serve` process and a local tansu broker,
judged on what its plots show, while it runs and at the end.

    python -m loadtest.soak                     # 3 minutes (make soak)
    python -m loadtest.soak --duration 3600     # an hour

Two lookup threads check every served row (it encodes its key and version: never a version that was not
published); a publisher sends ``--rows-per-s`` distinct rows every ``--publish-every`` seconds. The verdict:

- correct: zero lookup and publish errors, zero wrong rows, every key at its latest version at the end, exit 0;
- fresh: FAIL as soon as published rows wait and no update was applied for ``--max-no-apply`` seconds (30);
- lookups per interval, late vs early (median of the last third vs the first third after a warm-up): >= 0.8;
- lookup p99, late vs early: <= 1.5;
- memory: the server's PSS (its workers included) net of RocksDB's memtables and block-cache usage (both from /v1/stats) has no upward
  trend over the last half (robust fitted growth <= ``--max-mem-growth`` of its median).

The test broker's log is bounded: tansu's in-memory log serves a fetch more slowly the more record batches it
holds (tens of thousands make fetches take seconds), and its DeleteRecords is not implemented (the broker drops
the connection), so the soak bounds the volume instead: one record batch per partition per publish, at most
``--max-record-batches`` over the run (the publish interval grows to fit), compressed with lz4. The plot adds the
broker's CPU and RSS, since the broker shares the machine. Samples, plot and verdict go under ``--out``.
"""
