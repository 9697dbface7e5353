"""A 20-second version of `make soak`: mixed lookups and Kafka updates against a real server and broker; zero
errors and wrong rows, every key at its latest version, RSS (less RocksDB memtables) without an upward trend, and
the samples plotted to a PNG. The p99 trend is printed, not asserted (the test machine is shared and noisy)."""

from __future__ import annotations

from pathlib import Path

from loadtest.soak import run_soak


def test_short_soak(kafka_broker, tmp_path: Path) -> None:
    result = run_soak(20.0, 1.0, tmp_path, brokers=kafka_broker.bootstrap, keys=10_000, dim=16)
    print(f"\nshort soak: {result.lookups} lookups, {result.rows_published} rows published, RSS trend "
          f"{result.rss_growth:+.1%}, p99 late/early {result.p99_ratio:.2f}, plot {result.plot}")
    assert result.lookups > 100 and result.rows_published > 1000
    assert result.lookup_errors == [] and result.publish_errors == [] and result.wrong_rows == 0
    assert result.stale_keys_at_end == 0 and result.server_exit == 0
    assert result.rss_growth <= 0.10, [s.rss_mib - s.memtable_mib for s in result.samples]
    assert (tmp_path / "soak.png").stat().st_size > 10_000 and (tmp_path / "soak.json").is_file()
