"""The frame every runnable loadtest module shares: its command line, each ratio printed beside its target with PASS
or MISS, and its results written as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

#: The checkout, and where results go unless ``--out`` says otherwise.
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "loadtest" / "results"


def parser(spec: ModuleSpec | None, doc: str | None) -> argparse.ArgumentParser:
    """The module's parser (pass its ``__spec__`` and ``__doc__``): named ``python -m <module>``, the docstring as
    written for its description."""
    prog = f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None else None
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_out(ap: argparse.ArgumentParser, default: Path = RESULTS) -> None:
    """``--out DIR``: the directory the results are written to."""
    ap.add_argument("--out", type=Path, default=default, help=f"directory of the results (default {default})")


def add_json(ap: argparse.ArgumentParser) -> None:
    """``--json PATH``: also write the result there."""
    ap.add_argument("--json", type=Path, default=None, help="write the result here as JSON")


def run(main: Callable[[], int | None]) -> NoReturn:
    """Exit with what ``main()`` returns, None as 0: the last line of every runnable module."""
    sys.exit(main() or 0)


def console(width: int = 150) -> Console:
    """A console at least ``width`` columns wide, so that tables of ratios do not fold."""
    return Console(width=max(Console().width, width))


@dataclass(frozen=True)
class Target:
    """What a ratio must reach: at least ``bound``, or at most with ``at_most``."""

    bound: float
    at_most: bool = False

    def met(self, ratio: float) -> bool:
        return ratio <= self.bound if self.at_most else ratio >= self.bound

    def __str__(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.bound:.3g}"


def at_least(bound: float) -> Target:
    return Target(bound)


def at_most(bound: float) -> Target:
    return Target(bound, at_most=True)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def judged(ratio: float, target: Target) -> str:
    """``1.23x (target >= 0.5: PASS)``: a ratio beside its target and whether it met it."""
    return f"{ratio:.2f}x (target {target}: {verdict(target.met(ratio))})"


class RatioTable:
    """The table of ratios: each benchmark's figure beside its baseline's, the ratio, its target, PASS or MISS."""

    def __init__(self, title: str) -> None:
        self.table = Table(title=title, header_style="bold")
        for col in ("benchmark", "ours", "baseline", "ratio", "target", "met"):
            self.table.add_column(col, justify="left" if col == "benchmark" else "right")

    def row(self, name: str, ours: str = "", base: str = "", ratio: float | None = None,
            target: Target | str = "-", ok: bool | None = None) -> None:
        """One row; ``ok`` defaults to whether ``ratio`` meets a :class:`Target` (no verdict for a target in words)."""
        if ok is None and ratio is not None and isinstance(target, Target):
            ok = target.met(ratio)
        met = "-" if ok is None else f"[green]{verdict(ok)}[/]" if ok else f"[red]{verdict(ok)}[/]"
        self.table.add_row(name, ours, base, "-" if ratio is None else f"{ratio:.2f}x", str(target), met)

    def __rich__(self) -> Table:
        return self.table


def write_json(data: Any, path: Path) -> Path:
    """``data`` as indented JSON at ``path`` (its directory made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False))
    return path


def write_result(data: Any, out: Path, stem: str) -> Path:
    """``data`` as JSON at ``<out>/<stem>-<date>-<time>.json``."""
    return write_json(data, out / time.strftime(f"{stem}-%Y%m%d-%H%M%S.json"))
