"""The RocksDB tier's ordered scan: every entry once, rows and tombstones with their versions, across the signed
key boundary and from any key on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps_service.tiers.rocksdb.tier import RocksDBTier


def test_a_scan_walks_every_entry_once_in_stretches(tmp_path: Path) -> None:
    tier = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    tier.create_table("m.t", 3)
    keys = np.array([0, 1, 2, 2**63 - 1, -1, -(2**63), 12345, -777], dtype=np.int64)
    vectors = np.arange(keys.size * 3, dtype=np.float32).reshape(-1, 3)
    tier.put("m.t", keys, vectors, np.arange(keys.size, dtype=np.int64) + 10)
    tier.delete("m.t", np.array([1, -777], np.int64), np.array([50, 60], np.int64))
    seen: list[np.ndarray] = []
    after = None
    while True:
        part = tier.scan("m.t", after, 3)
        seen.append(part.keys)
        by_key = dict(zip(part.keys.tolist(), range(part.keys.size)))
        for k, i in by_key.items():
            j = int(np.flatnonzero(keys == k)[0])
            if k in (1, -777):
                assert not part.live[i] and part.versions[i] == (50 if k == 1 else 60)
                assert (part.vectors[i] == 0).all()
            else:
                assert part.live[i] and part.versions[i] == j + 10
                np.testing.assert_array_equal(part.vectors[i], vectors[j])
        if part.keys.size < 3:
            break
        after = int(part.keys[-1])
    walked = np.concatenate(seen)
    assert sorted(walked.tolist()) == sorted(keys.tolist()) and walked.size == keys.size
    assert walked.astype(np.uint64).tolist() == sorted(walked.astype(np.uint64).tolist())  # unsigned byte order
    assert tier.scan("m.t", int(walked[-1]), 3).keys.size == 0
    assert tier.scan("m.t", 5, 100).keys.tolist() == walked[walked.astype(np.uint64) > 5].tolist()  # 5 not stored
    write = tier.scan("m.t", None, 100)
    w = write.write("m.u", write.vectors[write.live])
    assert sorted(w.delete_keys.tolist()) == [-777, 1] and w.keys.size == keys.size - 2
    tier.close()
