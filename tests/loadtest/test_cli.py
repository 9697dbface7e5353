"""The frame of the runnable loadtest modules: a ratio judged against its target, the table of ratios, the parser's
name and the results' path."""

from __future__ import annotations

import json
from importlib.machinery import ModuleSpec
from pathlib import Path

from rich.console import Console

from loadtest.harness import cli


def test_a_ratio_is_judged_against_its_target() -> None:
    assert cli.judged(0.61, cli.at_least(0.5)) == "0.61x (target >= 0.5: PASS)"
    assert cli.judged(1.6, cli.at_most(1.5)) == "1.60x (target <= 1.5: MISS)"
    assert str(cli.at_most(1 / 0.95)) == "<= 1.05" and cli.at_most(1 / 0.95).met(1.052)


def test_the_ratio_table_prints_pass_miss_and_no_verdict_for_a_target_in_words() -> None:
    t = cli.RatioTable("ratios")
    t.row("met", "1 ms", "2 ms", 2.0, cli.at_least(1.2))
    t.row("missed", "", "", 0.5, cli.at_least(1.2))
    t.row("in words", "", "", 3.0, "grows")
    t.row("forced", "", "", 1.0, cli.at_most(1.2), ok=False)
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(t)
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if line.startswith("│ ")}
    assert lines["met"].rstrip(" │").endswith("PASS") and lines["missed"].rstrip(" │").endswith("MISS")
    assert lines["in"].rstrip(" │").endswith("-") and lines["forced"].rstrip(" │").endswith("MISS")


def test_the_parser_is_named_after_the_module_and_results_are_dated(tmp_path: Path) -> None:
    assert cli.parser(ModuleSpec("loadtest.soak.__main__", None), "doc").prog == "python -m loadtest.soak"
    path = cli.write_result({"a": 1}, tmp_path / "out", "bench-x")
    assert path.parent == tmp_path / "out" and path.name.startswith("bench-x-") and json.loads(path.read_text()) == {"a": 1}
