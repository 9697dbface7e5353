"""scripts/progress.sh, which make install runs pip under: a line every PROGRESS_EVERY_S seconds while the command
runs (pip unpacks wheels without a word), the command's own output passed through, and its exit status kept."""

from __future__ import annotations

import os
import subprocess

from tests.helpers import REPO

SCRIPT = str(REPO / "scripts" / "progress.sh")


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, "unpacking wheels", *command], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PROGRESS_EVERY_S": "1"})


def test_a_silent_command_gets_a_line_a_second_and_its_status_is_kept() -> None:
    done = _run("sh", "-c", "echo started; sleep 2.6; exit 3")
    assert done.returncode == 3
    lines = done.stdout.splitlines()
    # one line a second (a busy machine may delay the last beyond the command's end: one or two of them)
    assert lines[0] == "started" and 2 <= len(lines) <= 3, lines
    assert lines[1:] == [f"  ... unpacking wheels, {k} s" for k in range(1, len(lines))], lines


def test_a_quick_command_prints_only_its_own_output() -> None:
    done = _run("echo", "done")
    assert done.returncode == 0 and done.stdout == "done\n"
