"""``train_command`` as ``hps train`` registers it: options parse, a short run writes its metrics, errors exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

import typer
from typer.testing import CliRunner

from hps_service.trainer.cli import train_command

CONFIG = """
updates: {type: disabled}
models:
  - name: demo
    tables:
      - {name: user, dim: 8}
      - {name: item, dim: 4}
"""


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("train")(train_command)
    app.command("noop")(lambda: None)  # a second command keeps "train" a subcommand, as in hps
    return app


def test_train_command_runs_and_measures_drift(tmp_path: Path) -> None:
    config = tmp_path / "hps.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "metrics.json"
    result = CliRunner().invoke(_app(), [
        "train", "--config", str(config), "--steps", "150", "--batch-size", "512", "--cardinality", "40",
        "--experts", "2", "--top-k", "1", "--eval-every", "25", "--holdout-size", "4000", "--drift-step", "100",
        "--drift-ids", "3", "--no-progress", "--metrics-out", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "not publishing" in result.output and "AUC" in result.output
    metrics = json.loads(out.read_text())
    assert metrics["steps"] == 150 and metrics["publishing"]["enabled"] is False
    assert len(metrics["moe"]["load_per_expert"]) == 2
    drift = metrics["drift"]
    assert drift["field"] == "user" and drift["ids"] == 3 and drift["step"] == 100
    assert drift["auc_gap_at_drift"] > drift["auc_gap_before"]  # the hottest ids moved: the model is off


def test_train_command_errors_exit_2_with_a_message(tmp_path: Path) -> None:
    config = tmp_path / "hps.yaml"
    config.write_text(CONFIG)
    result = CliRunner().invoke(_app(), ["train", "--config", str(config), "--model", "nope", "--steps", "1"])
    assert result.exit_code == 2 and "nope" in result.output
    result = CliRunner().invoke(_app(), ["train", "--config", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output
