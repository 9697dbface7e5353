"""A 20-second version of `make soak`: mixed lookups and Kafka updates against a real server and broker, judged
with the soak's own verdict: zero errors and wrong rows, every key at its latest version, updates applied
throughout, PSS (net of RocksDB memtables and block cache) without an upward trend over the last half, and the
samples (broker CPU and RSS included) plotted to a PNG. The lookup and p99 ratios are printed, not asserted (the
test machine is shared and noisy)."""

from __future__ import annotations

from pathlib import Path

from loadtest.soak.run import run_soak


def test_short_soak(kafka_broker, tmp_path: Path) -> None:
    result = run_soak(20.0, 1.0, tmp_path, brokers=kafka_broker.bootstrap, broker_pid=kafka_broker.process.pid,
                      keys=10_000, dim=16)
    print(f"\nshort soak: {result.lookups} lookups, {result.rows_published} rows published, "
          + "; ".join(f"{c.name}: {c.detail}" for c in result.checks) + f"; plot {result.plot}")
    checks = {c.name: c for c in result.checks}
    assert result.lookups > 100 and result.rows_published >= 50_000 and result.rows_applied >= result.rows_published
    assert checks["correct"].passed, checks["correct"].detail
    assert checks["fresh"].passed, checks["fresh"].detail
    assert result.mem_growth <= 0.10, [s.net_mib for s in result.samples]
    assert all(s.broker_rss_mib > 0 and s.broker_cpu >= 0 for s in result.samples)
    assert (tmp_path / "soak.png").stat().st_size > 10_000 and (tmp_path / "soak.json").is_file()
