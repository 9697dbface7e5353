"""Stream sources: a Kafka click log trained exactly once across SIGTERM and resume; a followed directory."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from confluent_kafka import Consumer, Producer, TopicPartition
from safetensors.numpy import load_file

from hps_service.config import load_config
from hps_service.trainer.checkpoint import latest_checkpoint
from hps_service.trainer.criteo import DENSE_FIELDS, SPARSE_FIELDS
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.stream_sources import DirectorySource
from hps_service.trainer.train import TrainConfig, Trainer
from tests.helpers import REPO
from tests.trainer.criteo_data import criteo_config, make_rows, write_parquet, write_tsv

FIELDS = 3
ROWS = 600


def _rows(start: int, n: int) -> dict[str, list]:
    """Click rows whose C3 is a unique sample id, so the ids trained count the samples trained."""
    cols = make_rows(n, seed=start, fields=FIELDS)
    cols["C3"] = [f"s{start + i}" for i in range(n)]
    return cols


def _lines(cols: dict[str, list], lo: int, hi: int) -> bytes:
    names = ["label", *DENSE_FIELDS, *SPARSE_FIELDS]
    return b"".join(("\t".join("" if cols[c][i] is None else str(cols[c][i]) for c in names) + "\n").encode()
                    for i in range(lo, hi))


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_kafka_click_log_is_trained_exactly_once_across_sigterm_and_resume(kafka_broker, tmp_path: Path) -> None:
    topic = f"clicks-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topics([topic], partitions=2)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    first = _rows(0, ROWS)
    for lo in range(0, ROWS, 20):  # Criteo lines, 20 a message
        producer.produce(topic, value=_lines(first, lo, lo + 20), partition=(lo // 20) % 2)
    producer.flush(30)
    config = criteo_config(tmp_path / "c.yaml", fields=FIELDS)
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, "-m", "hps_service.cli.main", "train", "--config", str(config), "--data",
            f"kafka://{kafka_broker.bootstrap}/{topic}", "--batch-size", "32", "--experts", "0", "--no-progress",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--eval-every", "10", "--kafka-group",
            f"g-{topic}"]
    run1 = subprocess.Popen([*base, "--metrics-out", str(tmp_path / "m1.json")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait(lambda: latest_checkpoint(ckpt) is not None or run1.poll() is not None, 120, "the first checkpoint")
    run1.send_signal(signal.SIGTERM)
    out1 = run1.communicate(timeout=120)[0]
    assert run1.returncode == 0, out1
    m1 = json.loads((tmp_path / "m1.json").read_text())
    assert m1["stopped"] and m1["samples"] > 0 and "(stopped)" in out1
    second = _rows(ROWS, ROWS)
    for i, lo in enumerate(range(0, ROWS, 150)):  # then Parquet batches, 150 rows a message
        buf = io.BytesIO()
        write_parquet(buf, {k: v[lo:lo + 150] for k, v in second.items()})
        producer.produce(topic, value=buf.getvalue(), partition=i % 2)
    producer.flush(30)
    # the log ends after what was produced: tansu's ListOffsets answers the last record batch's base offset + 1 as
    # the high watermark (15 lines produced in one batch read as 1), so it is counted here, not asked of the broker
    ends = {p: len(range(p, ROWS // 20, 2)) + len(range(p, len(range(0, ROWS, 150)), 2)) for p in range(2)}
    # the resumed run, in this process: the same options (shape) as the CLI's, stopped as SIGTERM stops it
    dlrm, source = build_run(load_config(config).models[0], RunSpec(
        data=(f"kafka://{kafka_broker.bootstrap}/{topic}",), data_format="criteo", experts=0,
        kafka_group=f"g-{topic}"))
    trainer = Trainer(dlrm, source, TrainConfig(batch_size=32, eval_every=10, checkpoint_dir=ckpt,
                                                checkpoint_every=10, resume=True))
    m2: dict = {}
    thread = threading.Thread(target=lambda: m2.update(trainer.run()))
    thread.start()
    try:
        _wait(lambda: not thread.is_alive() or trainer.position == {str(p): [ends[p], 0] for p in range(2)}, 90,
              "the resumed run to train every message")
    except AssertionError:
        raise AssertionError(f"position {trainer.position} samples {trainer.samples} ends {ends} alive "
                             f"{thread.is_alive()} m1 {m1['position']} {m1['samples']}") from None
    trainer.request_stop()
    thread.join(60)
    source.close()
    assert m2["resumed_from"] and m2["steps"] > m1["steps"] and m2["stopped"]
    # every sample trained exactly once: as many samples as produced, and every sample's own id among the rows
    assert m1["samples"] + m2["samples"] == 2 * ROWS
    shard = load_file(str(latest_checkpoint(ckpt) / "tables-rank0.safetensors"))
    assert np.unique(shard["C3/keys"]).size == 2 * ROWS
    assert m2["progressive"]["overall"]["samples"] == m2["samples"] and m2["final"]["kind"] == "progressive"
    # the group's offsets follow the checkpoint
    group = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": f"g-{topic}"})
    committed = group.committed([TopicPartition(topic, p) for p in range(2)], timeout=10)
    group.close()
    assert {tp.partition: tp.offset for tp in committed} == ends


def test_a_followed_directory_trains_files_as_they_land(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_tsv(inbox / "part-000.tsv", _rows(0, 250))
    source = DirectorySource(inbox, ("C1", "C2", "C3"), follow=True, poll_s=0.05, max_wait_s=0.2)
    torch_tables = tuple(TableSpec(f"C{i}", 4) for i in range(1, 4))
    model = DLRM(DLRMConfig(tables=torch_tables, num_dense=len(DENSE_FIELDS)), 10_000)
    trainer = Trainer(model, source, TrainConfig(batch_size=100, eval_every=1000, holdout_size=10))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(trainer.run()))
    thread.start()
    _wait(lambda: trainer.samples == 250, 60, "the first file")
    write_tsv(inbox / ".part-001.tsv", _rows(250, 300))  # written aside, then renamed into place
    (inbox / ".part-001.tsv").rename(inbox / "part-001.tsv")
    write_tsv(inbox / "part-002.tsv.tmp", _rows(550, 50))  # not complete yet: not read
    _wait(lambda: trainer.samples == 550, 60, "the file that landed")
    trainer.request_stop()
    thread.join(60)
    assert result["samples"] == 550 and result["stopped"]
    assert result["position"] == {"file": "part-001.tsv", "row": 300}
    assert np.unique(model.tables["C3"].keys[model.tables["C3"].live]).size == 550
