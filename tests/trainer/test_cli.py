"""``hps train`` / ``hps predict`` as registered: Criteo files end to end, options parse, errors exit 2 with a line."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import typer
from typer.testing import CliRunner

from hps_service.proto.hps.v1.update_pb2 import EmbeddingUpdate
from hps_service.trainer.cli import predict_command, train_command
from hps_service.updates.message import decode_update
from tests.trainer.criteo_data import criteo_config, make_rows, write_parquet, write_tsv
from tests.updates.test_publisher import read_all

CONFIG = """
updates: {type: disabled}
models:
  - name: demo
    tables:
      - {name: user, dim: 8, default: hashed_random}
      - {name: item, dim: 4}
"""


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("train")(train_command)
    app.command("predict")(predict_command)
    return app


def test_train_on_criteo_files_checkpoints_exports_and_resumes(tmp_path: Path) -> None:
    cols = make_rows(6000, seed=2, fields=6)
    tsv = write_tsv(tmp_path / "day_0.tsv", cols)
    config = criteo_config(tmp_path / "ctr.yaml", fields=6)
    out = tmp_path / "metrics.json"
    args = ["train", "--config", str(config), "--data", str(tsv), "--batch-size", "500", "--holdout", "last:1000",
            "--eval-every", "5", "--no-progress", "--metrics-out", str(out), "--max-rows-per-table", "150",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4", "--export-dir",
            str(tmp_path / "export"), "--export-every", "5", "--precision", "bf16", "--device", "cpu",
            "--moe-num-groups", "2", "--moe-group-topk", "1", "--moe-topk-scaling-factor", "1.5",
            "--capacity-factor", "1.5", "--moe-drop-policy", "position"]
    result = CliRunner().invoke(_app(), [*args, "--steps", "6"])
    assert result.exit_code == 0, result.output
    assert "not publishing" in result.output and "AUC" in result.output
    metrics = json.loads(out.read_text())
    assert metrics["steps"] == 6 and metrics["final"]["oracle_auc"] is None and metrics["precision"] == "bf16"
    assert metrics["tables"]["C1"]["rows"] <= 150 and metrics["tables"]["C1"]["evictions"] > 0
    assert [Path(p).name for p in metrics["checkpoints"]] == ["step-000000000004", "step-000000000006"]
    assert len(metrics["exports"]) == 2 and len(metrics["moe"]["load_over_time"]) == 2
    # run on to the end of the file (one pass: the 5000 training rows before the last 1000, held out)
    result = CliRunner().invoke(_app(), [*args, "--resume"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(out.read_text())
    assert metrics["steps"] == 10 and metrics["resumed_from"].endswith("step-000000000006")
    assert metrics["publishing"]["generation"] == 1 and metrics["samples"] == 4 * 500
    assert metrics["final"]["auc"] > 0.65  # a planted signal the model found
    parquet = write_parquet(tmp_path / "day_0.parquet", cols)
    result = CliRunner().invoke(_app(), ["train", "--config", str(config), "--data", str(parquet), "--steps", "2",
                                         "--batch-size", "256", "--holdout-size", "500", "--experts", "0",
                                         "--no-progress", "--metrics-out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["steps"] == 2


def test_train_on_synthetic_data_measures_drift(tmp_path: Path) -> None:
    config = tmp_path / "hps.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "metrics.json"
    result = CliRunner().invoke(_app(), [
        "train", "--config", str(config), "--steps", "150", "--batch-size", "512", "--cardinality", "40",
        "--experts", "2", "--top-k", "1", "--eval-every", "25", "--holdout-size", "4000", "--drift-step", "100",
        "--drift-ids", "3", "--no-progress", "--metrics-out", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "['item'] do not default to hashed_random" in result.output
    metrics = json.loads(out.read_text())
    assert metrics["steps"] == 150 and metrics["publishing"]["enabled"] is False
    assert len(metrics["moe"]["load_per_expert"]) == 2
    drift = metrics["drift"]
    assert drift["field"] == "user" and drift["ids"] == 3 and drift["step"] == 100
    assert drift["auc_gap_at_drift"] > drift["auc_gap_before"]  # the hottest ids moved: the model is off


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "nope"], "nope"),
        (["--top-k", "1", "--moe-score-function", "softmax", "--no-moe-expert-bias"], "top-k 1 with post-softmax"),
        (["--moe-score-function", "softmax"], "expert bias"),
        (["--moe-num-groups", "3"], "group"),
        (["--data", "{tsv}"], "C1..C26"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--precision", "fp8"], "precision"),
        (["--publish-precision", "int4"], "--publish-precision must be fp32, fp16, bf16 or int8"),
        (["--batch-size", "0"], "batch-size"),
        (["--experts", "2", "--top-k", "3"], "--top-k 3 is more than the 2 --experts"),
        (["--interaction", "fm"], "--interaction must be dot or dcn"),
        (["--bottom-mlp", "64,x"], "comma-separated layer widths"),
        (["--holdout", "first:10"], "--holdout takes last:N"),
        (["--data", "kafka://127.0.0.1:1/t", "--holdout", "last:10"], "progressive validation"),
        (["--data", "kafka://nowhere"], "expected kafka://"),
        (["--follow", "--data", "{tsv}", "--data", "{tsv}"], "--follow needs one --data"),
    ],
)
def test_train_errors_exit_2_with_a_message(tmp_path: Path, extra: list[str], message: str) -> None:
    config = tmp_path / "hps.yaml"
    config.write_text(CONFIG)
    tsv = write_tsv(tmp_path / "x.tsv", make_rows(10))
    extra = [e.replace("{tsv}", str(tsv)) for e in extra]
    result = CliRunner().invoke(_app(), ["train", "--config", str(config), "--steps", "1", "--no-progress",
                                         "--metrics-out", str(tmp_path / "m.json"), *extra])
    assert result.exit_code == 2 and message in result.output, result.output


def test_predict_errors_exit_2_with_a_message(tmp_path: Path) -> None:
    tsv = write_tsv(tmp_path / "x.tsv", make_rows(10))
    result = CliRunner().invoke(_app(), ["predict", "--export-dir", str(tmp_path / "none"), "--data", str(tsv)])
    assert result.exit_code == 2 and "no exported model" in result.output, result.output


def test_resuming_with_another_shape_is_one_error_line(tmp_path: Path) -> None:
    config = tmp_path / "hps.yaml"
    config.write_text(CONFIG)
    args = ["train", "--config", str(config), "--steps", "2", "--batch-size", "64", "--no-progress", "--experts",
            "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "m.json")]
    assert CliRunner().invoke(_app(), args).exit_code == 0
    result = CliRunner().invoke(_app(), [*args, "--resume", "--top-mlp", "16", "--interaction", "dcn"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "another model shape" in result.output, result.output
    assert "interaction: checkpoint 'dot', this run 'dcn'" in result.output and "Traceback" not in result.output


def test_train_creates_its_update_topic_with_the_configured_replication(kafka_broker, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``updates.replication_factor``, not the publisher's default of 3: on one broker the topic is capped at 1
    with a warning that names the configured factor. ``--publish-precision int8`` publishes int8 rows."""
    config = tmp_path / "hps.yaml"
    prefix = f"rf{uuid.uuid4().hex[:8]}"
    config.write_text(CONFIG.replace("updates: {type: disabled}", (
        f"updates: {{type: kafka, brokers: '{kafka_broker.bootstrap}', topic_prefix: {prefix}, "
        "replication_factor: 2, min_insync_replicas: 1}")))
    with caplog.at_level(logging.WARNING, logger="hps_service.updates.topics"):
        result = CliRunner().invoke(_app(), ["train", "--config", str(config), "--steps", "1", "--batch-size", "64",
                                             "--experts", "0", "--no-progress", "--metrics-out", str(tmp_path / "m"),
                                             "--publish-precision", "int8"])
    assert result.exit_code == 0, result.output
    created = [r.getMessage() for r in caplog.records if "created with replication factor" in r.getMessage()]
    assert created and all("not updates.replication_factor=2" in m for m in created), created
    messages = read_all(kafka_broker.bootstrap, f"{prefix}.demo", 24, expect=2, timeout=10)
    assert messages and all(EmbeddingUpdate.FromString(m.value()).storage == 3 for m in messages)
    assert all(decode_update(m.value()).vectors.dtype == np.float32 for m in messages)
