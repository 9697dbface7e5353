"""A TorchRec DLRM, trained a few steps on the CPU, its embedding tables served by hps-service: the round trip.

    python examples/torchrec_dlrm.py                 # trains, exports, serves, compares; exits 1 if they differ

1. Train: TorchRec's ``DLRM`` over an ``EmbeddingBagCollection`` of four tables, a few Adam steps on synthetic
   clicks (13 dense features, four sparse ones with bags of 0 to 6 ids).
2. Export: ``torch.save(model.state_dict(), "dlrm.pt")``; the EBC's rows are ``...embedding_bags.<table>.weight``.
3. Import: ``hps serve`` with model ``dlrm`` of the same four tables, and each table imported from ``dlrm.pt`` by
   the REST import (``hps import dlrm.pt --model dlrm --table t0`` does the same before the server starts).
4. Serve: the same DLRM with ``HPSEmbeddingBagCollection`` in the EBC's place, the trained state_dict loaded into it
   (its dense layers; the served rows answer for the tables), over gRPC and over ``LocalClient``.
5. Compare the served model's predictions with the trained model's on fresh batches: equal within 1e-5.

Needs ``hps-service`` and ``hps-client[torch]`` with TorchRec (``make install-dev`` installs them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import yaml
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM

from hps_client import HPSClient
from hps_client.torchrec import HPSEmbeddingBagCollection
from hps_service.local import LocalClient
from hps_service.runtime.processes import free_port, stop_process

TABLES, ROWS, DIM, DENSE = 4, 1000, 16, 13
TOKEN = "dlrm-example"


def configs() -> list[EmbeddingBagConfig]:
    """Four tables of ROWS x DIM, one sparse feature each, pooled by sum."""
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"cat_{i}"],
                               pooling=PoolingType.SUM) for i in range(TABLES)]


def dlrm(ebc: torch.nn.Module) -> DLRM:
    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[32, DIM],
                over_arch_layer_sizes=[32, 1])


def batch(gen: torch.Generator, size: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Dense features, sparse ones (some bags empty) and clicks that depend on both (the first dense feature and
    the odd ids in the first sparse feature's bag)."""
    dense = torch.randn(size, DENSE, generator=gen)
    lengths = torch.randint(0, 7, (TABLES * size,), generator=gen)
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"cat_{i}" for i in range(TABLES)], values=ids,
                                                 lengths=lengths)
    first = torch.zeros(size).index_add_(0, torch.arange(size).repeat_interleave(lengths[:size]),
                                         (ids[:int(lengths[:size].sum())] % 2).float())
    return dense, sparse, ((dense[:, 0] + first) > 1.0).float()


def train(steps: int, gen: torch.Generator) -> DLRM:
    """The DLRM trained ``steps`` Adam steps on batches of 256."""
    model = dlrm(EmbeddingBagCollection(tables=configs(), device=torch.device("cpu")))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(steps):
        dense, sparse, clicks = batch(gen, 256)
        loss = loss_fn(model(dense, sparse).squeeze(1), clicks)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in (0, steps - 1):
            print(f"step {step}: loss {loss.item():.4f}")
    return model.eval()


class Server:
    """``hps serve`` of model ``dlrm`` on free ports, with a colocated store under ``workdir``'s shm twin."""

    def __init__(self, workdir: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.store = Path(tempfile.mkdtemp(prefix="hps-dlrm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.config = workdir / "hps.yaml"
        self.config.write_text(yaml.safe_dump({
            "server": {"host": "127.0.0.1", "grpc_port": self.grpc_port, "http_port": self.http_port,
                       "admin_token": TOKEN, "workers": 1, "local": {"enabled": True, "path": str(self.store)}},
            "persistent": {"type": "rocksdb", "path": str(workdir / "db"), "block_cache_mb": 8},
            "models": [{"name": "dlrm", "tables": [{"name": c.name, "dim": c.embedding_dim} for c in configs()]}],
        }))
        self.log = open(workdir / "hps.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "hps_service.cli.main", "serve", "--config",
                                      str(self.config)], stdout=self.log, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.http_port}", timeout=60,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with HPSClient(self.target) as client:
                client.wait_ready(timeout=120)
        except BaseException:
            self.stop()
            raise

    def import_table(self, table: str, path: Path) -> int:
        """The REST import of ``table`` from ``path``, waited for; the rows it wrote."""
        job = self.http.post(f"/v1/models/dlrm/tables/{table}/import", json={"path": str(path)}).json()
        while job["state"] not in ("succeeded", "failed"):
            time.sleep(0.05)
            job = self.http.get(f"/v1/jobs/{job['id']}").json()
        if job["state"] != "succeeded":
            raise RuntimeError(f"import of {table} failed: {job['error']}")
        return int(job["result"]["rows_written"])

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc, 30)
        self.log.close()
        shutil.rmtree(self.store, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps")
    ap.add_argument("--workdir", type=Path, default=None, help="where the export, config and store go (default: "
                                                                "a temporary directory)")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hps-dlrm-example-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    trained = train(args.steps, gen)
    export = workdir / "dlrm.pt"
    torch.save(trained.state_dict(), export)
    print(f"exported the trained state_dict to {export}")
    server = Server(workdir)
    worst = 0.0
    try:
        for c in configs():
            print(f"imported {server.import_table(c.name, export)} rows of {c.name} from {export.name}")
        with HPSClient(server.target) as grpc_client, LocalClient(server.store) as local_client:
            for name, client in (("gRPC", grpc_client), ("LocalClient", local_client)):
                served = dlrm(HPSEmbeddingBagCollection(client, "dlrm", tables=configs()))
                served.load_state_dict(trained.state_dict())  # the dense layers; the tables are served
                served.eval()
                with torch.no_grad():
                    diffs = [(served(dense, sparse) - trained(dense, sparse)).abs().max().item()
                             for dense, sparse, _ in (batch(gen, 512) for _ in range(3))]
                worst = max(worst, *diffs)
                print(f"served through {name}: 3 batches of 512, max |served - trained| = {max(diffs):.2e}")
    finally:
        server.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    ok = worst <= 1e-5
    print(f"predictions {'equal' if ok else 'DIFFER'} within 1e-5 (max |diff| {worst:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
