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

import torch.distributed as dist
import torch.multiprocessing as mp

from hps_service.trainer.criteo import CriteoFiles
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.sources import FileSource
from hps_service.trainer.train import TrainConfig, Trainer
from hps_service.updates.partitioning import partition_of
from hps_service.updates.topics import DEFAULT_PARTITIONS
from tests.helpers import REPO
from tests.trainer.criteo_data import criteo_config, make_rows, write_tsv

FIELDS = 4


def _rank_main(rank: int, world: int, init: str, tsv: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        names = tuple(f"C{i}" for i in range(1, FIELDS + 1))
        dlrm = DLRM(DLRMConfig(tables=tuple(TableSpec(n, 8) for n in names), num_dense=13,
                               moe=MoEConfig(num_experts=2, top_k=1, ffn_hidden=8), moe_hidden=8))
        source = FileSource(CriteoFiles([Path(tsv)], "criteo", names), holdout_rows=400)
        store = LatestRowStore({n: 8 for n in names})
        metrics = Trainer(dlrm, source, TrainConfig(batch_size=400, eval_every=100, holdout_size=400,
                                                    publish_every_steps=2), publisher=store).run()
        held = {n: store.held(n) for n in names}
        live = {n: dlrm.tables[n].keys[dlrm.tables[n].live] for n in names}
        np.savez(out, **{f"held_{n}": v for n, v in held.items()}, **{f"live_{n}": v for n, v in live.items()},
                 auc=metrics["final"]["auc"], steps=metrics["steps"], bias=np.array(metrics["moe"]["expert_bias"]))
    finally:
        dist.destroy_process_group()


def test_each_rank_owns_and_publishes_only_the_keys_of_its_partitions(tmp_path: Path) -> None:
    tsv = write_tsv(tmp_path / "d.tsv", make_rows(2400, seed=8, fields=FIELDS))
    outs = [str(tmp_path / f"rank{r}.npz") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, 2, f"file://{tmp_path / 'rdzv'}", str(tsv), outs[r]))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = [np.load(o) for o in outs]
    assert int(results[0]["steps"]) == int(results[1]["steps"]) == 5  # 2000 training rows / 400
    assert float(results[0]["auc"]) == float(results[1]["auc"])  # both ranks evaluated the same gathered holdout
    np.testing.assert_array_equal(results[0]["bias"], results[1]["bias"])  # all-reduced expert loads
    seen = CriteoFiles([tsv], "criteo", tuple(f"C{i}" for i in range(1, FIELDS + 1)))
    train_rows = list(seen.batches(400, skip_rows=400))
    for i in range(1, FIELDS + 1):
        name = f"C{i}"
        expected = np.unique(np.concatenate([b.sparse[name].ravel() for b in train_rows]))
        for rank, res in enumerate(results):
            owner = partition_of(res[f"held_{name}"], DEFAULT_PARTITIONS) % 2
            assert (owner == rank).all()  # published only what it owns
            assert np.array_equal(np.sort(res[f"live_{name}"]), res[f"held_{name}"])
        both = np.concatenate([results[0][f"held_{name}"], results[1][f"held_{name}"]])
        assert np.array_equal(np.sort(both), expected)  # together: every trained key, once


def _train(args: list[str], nproc: int, env: dict) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*launcher, "-m", "hps_service.trainer", *args] if nproc > 1 else [sys.executable, "-m",
                                                                              "hps_service.trainer", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_two_processes_reach_the_single_process_auc(tmp_path: Path) -> None:
    tsv = write_tsv(tmp_path / "day.tsv", make_rows(8000, seed=9, fields=FIELDS))
    config = criteo_config(tmp_path / "ctr.yaml", fields=FIELDS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    metrics = {}
    for nproc in (1, 2):
        out = tmp_path / f"m{nproc}.json"
        _train(["--config", str(config), "--data", str(tsv), "--batch-size", "1000", "--holdout-size", "2000",
                "--eval-every", "5", "--no-progress", "--metrics-out", str(out), "--device", "cpu"], nproc, env)
        metrics[nproc] = json.loads(out.read_text())
    one, two = metrics[1], metrics[2]
    print(f"samples/s: 1 process {one['samples_per_s']:,.0f}, 2 processes {two['samples_per_s']:,.0f}; "
          f"AUC {one['final']['auc']:.4f} vs {two['final']['auc']:.4f}")
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["steps"] == one["steps"] == 6
    assert one["final"]["auc"] > 0.65
    assert abs(two["final"]["auc"] - one["final"]["auc"]) < 0.01
