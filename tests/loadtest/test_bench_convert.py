"""``loadtest.benchmarks.convert`` (make bench part 13d) runs end to end on a small table and reports each phase, and the
ratio table shows its row."""

from __future__ import annotations

import pytest
from rich.console import Console

from hps_service.engine import convert as convert_module
from loadtest.benchmarks import convert as convert_bench
from loadtest.harness.summary import ratio_table


def test_the_conversion_bench_reports_every_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_bench, "WINDOW_S", 0.3)
    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.2)
    out = convert_bench.run(20_000, 16, Console(file=open("/dev/null", "w")))  # noqa: SIM115
    assert out["entries_per_s"] > 0 and out["copy_s"] > 0
    assert set(out["lookups"]) == {"before", "copy", "switch", "after"}
    assert out["lookups"]["before"]["n"] > 0 and out["lookups"]["after"]["n"] > 0
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(ratio_table({"storage_convert": out}))
    assert "13d. lookup p99 while a table converts" in console.export_text()
