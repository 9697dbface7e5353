"""``loadtest.benchmarks.rollout`` (make bench part 14) runs end to end on two replicas and a small table, and the ratio
table shows its rows."""

from __future__ import annotations

from rich.console import Console

from loadtest.benchmarks import rollout
from loadtest.harness.summary import ratio_table


def test_the_rollout_bench_times_a_version_to_ready_everywhere_and_the_lookups_meanwhile() -> None:
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    res = rollout.run(20_000, 16, 2, quiet, poll_s=0.2, workers=0, before_s=1.0)
    assert len(res["ready_s"]) == 2 and all(0 < s < 120 for s in res["ready_s"])
    assert res["import_s"] > 0 and res["lookups_before"] > 10 and res["p99_before_s"] > 0
    assert all("import_s" in p for p in res["phases"]), res["phases"]
    console = Console(record=True, width=220, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(ratio_table({"rollout": res}))
    text = console.export_text()
    assert "15. version of 20,000 x 16 from the repository to ready on 2 replicas" in text
    assert "15. lookup p99 while it loads" in text
