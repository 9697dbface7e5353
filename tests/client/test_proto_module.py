"""The protos as a buf module (protos/buf.yaml): `buf lint` is clean, and `buf breaking` against the released image
(protos/released/hps.v1.json) passes on a copy of the protos as they are and fails on one with a field renumbered."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, run_make

BUF = REPO / "build/node/node_modules/.bin/buf"
RELEASED = REPO / "protos/released/hps.v1.json"


@pytest.fixture(scope="module")
def buf() -> Path:
    """The buf CLI, installed by `make buf` (npm's @bufbuild/buf into build/node) where it is not yet."""
    made = run_make("buf", timeout=300)
    assert made.returncode == 0, f"make buf failed:\n{made.stdout}{made.stderr}"
    return BUF


def scratch_protos(tmp_path: Path) -> Path:
    """A copy of the module (buf.yaml and hps/v1/*.proto) to change."""
    copy = tmp_path / "protos"
    shutil.copytree(REPO / "protos", copy, ignore=shutil.ignore_patterns("released"))
    return copy


def breaking(buf: Path, module: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(buf), "breaking", str(module), "--against", str(RELEASED)], capture_output=True,
                          text=True, timeout=120)


def test_lint_is_clean(buf: Path) -> None:
    linted = subprocess.run([str(buf), "lint", "protos"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_unchanged_copy_is_not_breaking(buf: Path, tmp_path: Path) -> None:
    result = breaking(buf, scratch_protos(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_renumbered_field_is_breaking(buf: Path, tmp_path: Path) -> None:
    module = scratch_protos(tmp_path)
    proto = module / "hps/v1/embedding.proto"
    text = proto.read_text()
    assert "  bytes sources = 5;" in text
    proto.write_text(text.replace("  bytes sources = 5;", "  bytes sources = 99;"))
    result = breaking(buf, module)
    assert result.returncode != 0
    assert 'Previously present field "5" with name "sources" on message "TableVectors" was deleted' in result.stdout


def test_language_options_are_part_of_the_release(buf: Path, tmp_path: Path) -> None:
    """A Java user's package is as much a promise as a field number: changing java_package breaks too."""
    module = scratch_protos(tmp_path)
    proto = module / "hps/v1/rows.proto"
    proto.write_text(proto.read_text().replace('option java_package = "com.hps.v1";',
                                               'option java_package = "org.hps.v1";'))
    result = breaking(buf, module)
    assert result.returncode != 0 and 'File option "java_package" changed' in result.stdout, result.stdout
