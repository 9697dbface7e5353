"""Data-parallel training: torchrun with gloo on the CPU, embeddings owned by partition, DDP for the dense tower."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.numpy import load_file

from hps_service.config import load_config
from hps_service.trainer.criteo import CriteoFiles
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.train import TrainConfig, Trainer
from hps_service.updates.partitioning import partition_of
from hps_service.updates.topics import DEFAULT_PARTITIONS
from tests.helpers import REPO
from tests.trainer.criteo_data import criteo_config, make_rows, write_tsv

FIELDS = 4


def test_two_processes_reach_the_single_process_auc_and_each_owns_its_partitions(tmp_path: Path) -> None:
    tsv = write_tsv(tmp_path / "day.tsv", make_rows(8000, seed=9, fields=FIELDS))
    config = criteo_config(tmp_path / "ctr.yaml", fields=FIELDS)
    names = tuple(f"C{i}" for i in range(1, FIELDS + 1))
    common = ["--config", str(config), "--data", str(tsv), "--batch-size", "1000", "--holdout", "last:2000",
              "--eval-every", "3", "--no-progress", "--device", "cpu"]
    out = tmp_path / "m2.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*launcher, "-m", "hps_service.trainer", *common, "--metrics-out", str(out), "--checkpoint-dir",
         str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads(out.read_text())
    # the same run in one process (this one), on the same global batches
    torch.manual_seed(0)
    cfg = load_config(config)
    dlrm, source = build_run(cfg.models[0], RunSpec(data_format="criteo", data=(str(tsv),), holdout_last=2000,
                                                    max_rows_per_table=10_000_000))
    one = Trainer(dlrm, source, TrainConfig(batch_size=1000, eval_every=3, holdout_size=2000), model_name="ctr").run()
    print(f"samples/s: 1 process {one['samples_per_s']:,.0f}, 2 processes {two['samples_per_s']:,.0f}; "
          f"AUC {one['final']['auc']:.4f} vs {two['final']['auc']:.4f}")
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["steps"] == one["steps"] == 6
    assert one["final"]["auc"] > 0.65
    assert abs(two["final"]["auc"] - one["final"]["auc"]) < 0.01
    # each rank held (and so published) only the rows of its partitions; together every trained key once
    shards = [load_file(str(tmp_path / "ckpt" / "step-000000000006" / f"tables-rank{r}.safetensors"))
              for r in range(2)]
    trained = list(CriteoFiles([tsv], "criteo", names).batches(1000))[:6]  # the last 2000 rows are held out
    for name in names:
        for rank, shard in enumerate(shards):
            assert (partition_of(shard[f"{name}/keys"], DEFAULT_PARTITIONS) % 2 == rank).all()
        both = np.sort(np.concatenate([shard[f"{name}/keys"] for shard in shards]))
        assert np.array_equal(both, np.unique(np.concatenate([b.sparse[name].ravel() for b in trained])))
        assert np.array_equal(both, np.sort(dlrm.tables[name].keys[dlrm.tables[name].live]))
