"""``loadtest.benchmarks.versions`` (make bench part 13e) runs end to end on a small fleet and table, and the ratio table
shows its rows."""

from __future__ import annotations

from rich.console import Console

from loadtest.benchmarks import versions
from loadtest.harness.summary import ratio_table


def test_the_versions_bench_measures_a_switch_on_every_replica_and_the_memory_a_drop_frees() -> None:
    sw = versions.run_switch(2, 2)
    assert len(sw["put_s"]) == 2 and all(len(v) == 2 for v in sw["visible_s"])
    assert all(0 < s < 30 for v in sw["visible_s"] for s in v)
    mem = versions.run_memory(20_000, 16)
    assert mem["added"]["hashmap"] > 0 and mem["freed_ratio"]["hashmap"] == 1.0
    assert mem["added"]["rocksdb"] > 0 and mem["freed"]["rocksdb"] > 0
    console = Console(record=True, width=220, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(ratio_table({"versions": {"switch": sw, "memory": mem}}))
    text = console.export_text()
    assert "13e. label switch" in text and "13e. memory a dropped version frees" in text
