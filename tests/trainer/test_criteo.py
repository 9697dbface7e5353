"""Criteo-format files: TSV and Parquet read as the same stream, FNV-1a keys, empty fields, resumable positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.criteo import DENSE_FIELDS, SPARSE_FIELDS, CriteoFiles, dense_transform, encode, fnv1a64
from tests.trainer.criteo_data import make_rows, write_parquet, write_tsv


def _fnv1a_reference(text: str) -> int:
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h - 2**64 if h >= 2**63 else h


def test_keys_are_fnv1a_64_of_the_utf8_bytes() -> None:
    values = ["68fd1e64", "", "05db9164", "ünïcode", None, "a" * 100]
    got = fnv1a64(pa.array(values, type=pa.string()))
    expected = [_fnv1a_reference(v or "") for v in values]
    assert got.dtype == np.int64 and got.tolist() == expected
    assert _fnv1a_reference("a") % 2**64 == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector
    sliced = pa.array(values, type=pa.string()).slice(2, 3)  # arrays with an offset
    assert fnv1a64(sliced).tolist() == expected[2:5]


def test_tsv_and_parquet_give_the_same_batches_with_empty_fields(tmp_path: Path) -> None:
    cols = make_rows(2500, seed=3, fields=25)  # C26 left empty
    tsv = write_tsv(tmp_path / "day_0", cols)
    parquet = write_parquet(tmp_path / "day_0.parquet", cols)
    fields = ("C1", "C2", "C26")
    a = list(CriteoFiles([tsv], "criteo", fields).batches(1000))
    b = list(CriteoFiles([parquet], "parquet", fields).batches(1000))
    assert [len(x) for x in a] == [len(x) for x in b] == [1000, 1000, 500]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.dense, y.dense)
        np.testing.assert_array_equal(x.labels, y.labels)
        for f in fields:
            np.testing.assert_array_equal(x.sparse[f], y.sparse[f])
    first = a[0]
    assert first.sparse["C1"].shape == (1000, 1) and first.dense.shape == (1000, 13)
    c1 = cols["C1"][:1000]
    assert first.sparse["C1"].ravel().tolist() == [_fnv1a_reference(v or "") for v in c1]
    assert set(first.sparse["C26"].ravel().tolist()) == {_fnv1a_reference("")}  # an empty column
    raw = np.array([np.nan if v is None else v for v in cols["I1"][:1000]], dtype=float)
    np.testing.assert_allclose(first.dense[:, 0], np.log1p(np.maximum(np.nan_to_num(raw), 0)), rtol=1e-6)
    assert dense_transform(np.array([-3.0, np.nan, 0.0, np.e - 1])).tolist() == pytest.approx([0, 0, 0, 1])


def test_streams_resume_at_any_row_across_files(tmp_path: Path) -> None:
    cols = make_rows(1500, seed=4)
    half = {k: v[:700] for k, v in cols.items()}
    rest = {k: v[700:] for k, v in cols.items()}
    files = CriteoFiles([write_tsv(tmp_path / "a.tsv", half), write_tsv(tmp_path / "b.tsv", rest)], "criteo",
                        ("C3",))
    whole = np.concatenate([b.labels for b in files.batches(256)])
    assert whole.tolist() == [float(v) for v in cols["label"]]
    tail = list(files.batches(256, skip_rows=650))
    assert len(tail[0]) == 256
    np.testing.assert_array_equal(np.concatenate([b.labels for b in tail]), whole[650:])
    np.testing.assert_array_equal(np.concatenate([b.sparse["C3"] for b in tail]).ravel(),
                                  np.concatenate([b.sparse["C3"] for b in files.batches(256)]).ravel()[650:])


def test_rows_to_score_need_no_label() -> None:
    table = pa.table({**{c: [1, None] for c in DENSE_FIELDS}, "C1": ["ab", None]})
    batch = encode(table, ("C1",), require_label=False)
    assert batch.labels.tolist() == [0.0, 0.0] and batch.sparse["C1"].ravel().tolist() == [
        _fnv1a_reference("ab"), _fnv1a_reference("")]
    with pytest.raises(InvalidArgumentError, match="label"):
        encode(table, ("C1",))


def test_integer_categorical_columns_are_keys(tmp_path: Path) -> None:
    table = pa.table({"label": [0, 1, 1], **{c: [1, None, 5] for c in DENSE_FIELDS},
                      **{c: pa.array([-7, 2**62, 0], pa.int64()) for c in SPARSE_FIELDS}})
    pq.write_table(table, tmp_path / "ids.parquet")
    batch = next(CriteoFiles([tmp_path / "ids.parquet"], "parquet", ("C5",)).batches(10))
    assert batch.sparse["C5"].ravel().tolist() == [-7, 2**62, 0]


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="C1..C26"):
        CriteoFiles([tmp_path], "criteo", ("user",))
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        from hps_service.trainer.criteo import expand_paths

        expand_paths([tmp_path / "missing.tsv"])
    with pytest.raises(InvalidArgumentError, match="no column"):
        encode(pa.table({"label": [1]}), ("C1",))
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n")
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        list(CriteoFiles([bad], "criteo", ("C1",)).batches(10))
    (tmp_path / "labels.tsv").write_text("\t".join(["3"] + [""] * 39) + "\n")
    with pytest.raises(InvalidArgumentError, match="labels"):
        list(CriteoFiles([tmp_path / "labels.tsv"], "criteo", ("C1",)).batches(10))
