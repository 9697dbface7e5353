"""Small Criteo-format click logs made for the tests: a planted logistic signal over hex ids, empty fields, Parquet.

Each categorical field draws Zipf-skewed ids from its own vocabulary and writes them as 8-digit hex strings (as the
Kaggle/Terabyte files do); each id has a hidden effect on the click logit, and so does I1. Some fields are left
empty, some integers are negative.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps_service.trainer.criteo import DENSE_FIELDS, SPARSE_FIELDS


def make_rows(n: int, seed: int = 0, vocab: int = 200, fields: int = 26) -> dict[str, list]:
    """Columns label, I1..I13, C1..C26 (None = empty) of ``n`` rows whose labels follow a planted model."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab + 1) ** 1.1
    weights /= weights.sum()
    logit = np.full(n, -1.0)
    cols: dict[str, list] = {}
    for j, name in enumerate(SPARSE_FIELDS):
        if j >= fields:
            cols[name] = [None] * n
            continue
        ids = rng.choice(vocab, size=n, p=weights)
        vocab_hex = np.array([f"{v:08x}" for v in np.random.default_rng([seed, j]).integers(0, 2**32, vocab)])
        effect = np.random.default_rng([seed, j, 1]).normal(0.0, 0.8 if j < 4 else 0.1, vocab)
        logit += effect[ids]
        values = vocab_hex[ids].astype(object)
        values[rng.random(n) < 0.05] = None
        cols[name] = values.tolist()
    raw = rng.poisson(3.0, size=(n, len(DENSE_FIELDS))).astype(np.int64) - 1
    logit += 0.4 * np.log1p(np.maximum(raw[:, 0], 0))
    for j, name in enumerate(DENSE_FIELDS):
        values = raw[:, j].astype(object)
        values[rng.random(n) < 0.1] = None
        cols[name] = values.tolist()
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return {"label": labels.tolist(), **{k: cols[k] for k in DENSE_FIELDS}, **{k: cols[k] for k in SPARSE_FIELDS}}


def write_tsv(path: Path, columns: dict[str, list]) -> Path:
    """The Kaggle layout: tab-separated, no header, empty string for an empty field."""
    names = list(columns)
    with open(path, "w") as f:
        for i in range(len(columns["label"])):
            f.write("\t".join("" if columns[c][i] is None else str(columns[c][i]) for c in names) + "\n")
    return path


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("label", pa.int8())] + [(c, pa.int64()) for c in DENSE_FIELDS]
                       + [(c, pa.string()) for c in SPARSE_FIELDS])
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=1000)
    return path


def criteo_config(path: Path, fields: int = 26, dim: int = 8, brokers: str | None = None, model: str = "ctr",
                  extra: dict | None = None, storage: str = "fp32") -> Path:
    """An hps config whose model has tables C1..C<fields> (hashed_random defaults, rows stored as ``storage``)."""
    import yaml

    updates = {"type": "kafka", "brokers": brokers, "topic_prefix": "hps"} if brokers else {"type": "disabled"}
    data = {"updates": updates, "models": [{"name": model, "tables": [
        {"name": f"C{i}", "dim": dim, "default": "hashed_random", "storage": storage}
        for i in range(1, fields + 1)]}], **(extra or {})}
    path.write_text(yaml.safe_dump(data))
    return path
