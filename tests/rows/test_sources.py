"""Row files read a batch at a time (issue 53, part 4): every format gives back its rows exactly, in bounded memory;
a file cut short, of the wrong shape or without rows is refused when opened, naming the file and the problem."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import save_file

from hps_service.admin.importer import synthesize_model, write_hugectr_dir
from hps_service.errors import InvalidArgumentError
from hps_service.fleet.row_import import verify
from hps_service.rows.sources import open_rows


def _write_all(tmp: Path, keys: np.ndarray, rows: np.ndarray) -> list[Path]:
    """The same rows in every format (Parquet twice: variable and fixed-size lists)."""
    np.savez(tmp / "plain.npz", keys=keys, vectors=rows)
    np.savez_compressed(tmp / "packed.npz", keys=keys, vectors=rows)
    pq.write_table(pa.table({"key": keys, "vector": pa.array(list(rows), type=pa.list_(pa.float32()))}),
                   tmp / "lists.parquet", row_group_size=700)
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), rows.shape[1])
    pq.write_table(pa.table({"key": keys, "vector": fixed}), tmp / "fixed.parquet")
    save_file({"keys": keys, "vectors": rows}, str(tmp / "rows.safetensors"))
    write_hugectr_dir(tmp / "hugectr", keys, rows)
    return [tmp / n for n in ("plain.npz", "packed.npz", "lists.parquet", "fixed.parquet", "rows.safetensors",
                              "hugectr")]


def test_every_format_reads_back_its_rows_in_batches(tmp_path: Path) -> None:
    keys, rows = synthesize_model(2_345, 12, seed=5)
    for path in _write_all(tmp_path, keys, rows):
        source = open_rows(path)
        assert (source.rows, source.dim) == (2_345, 12), path
        batches = list(source.batches(1_000))
        assert [b[0].shape[0] for b in batches] == [1_000, 1_000, 345], path
        assert all(k.dtype == np.int64 and v.dtype == np.float32 and v.flags.c_contiguous for k, v in batches)
        np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), keys, err_msg=str(path))
        np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), rows, err_msg=str(path))


def test_a_large_file_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """A 200k x 64 file (51 MB of rows) read in batches of 4,096 never holds much more than a batch (1 MB)."""
    keys, rows = synthesize_model(200_000, 64, seed=6)
    paths = _write_all(tmp_path, keys, rows)
    del rows
    for path in paths:
        source = open_rows(path)
        tracemalloc.start()
        try:
            for _ in source.batches(4_096):
                pass
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, (path, peak)


def test_files_cut_short_or_of_the_wrong_shape_are_refused_when_opened(tmp_path: Path) -> None:
    keys, rows = synthesize_model(1_000, 8, seed=7)
    for path in _write_all(tmp_path, keys, rows)[:5]:
        cut = tmp_path / f"cut-{path.name}"
        cut.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
        with pytest.raises(InvalidArgumentError, match=r"cut short|ends .* short|fewer than") as err:
            list(open_rows(cut).batches(100))
        assert str(cut) in str(err.value)
    cases = []
    np.savez(tmp_path / "count.npz", keys=keys, vectors=rows[:-1])
    cases.append(("count.npz", "1000 keys but 999 vectors"))
    np.savez(tmp_path / "flat.npz", keys=keys, vectors=rows[:, 0])
    cases.append(("flat.npz", "must be 2-D"))
    np.savez(tmp_path / "nokeys.npz", vectors=rows)
    cases.append(("nokeys.npz", "lacks the array keys"))
    np.savez(tmp_path / "empty.npz", keys=keys[:0], vectors=rows[:0])
    cases.append(("empty.npz", "holds no rows"))
    np.savez(tmp_path / "words.npz", keys=keys.astype(str), vectors=rows)
    cases.append(("words.npz", "keys must be integers"))
    pq.write_table(pa.table({"id": keys, "vector": pa.array(list(rows))}), tmp_path / "names.parquet")
    cases.append(("names.parquet", "lacks the column"))
    ragged = [list(r) for r in rows]
    ragged[500] = ragged[500][:-1]
    pq.write_table(pa.table({"key": keys, "vector": pa.array(ragged, type=pa.list_(pa.float32()))}),
                   tmp_path / "ragged.parquet")
    cases.append(("ragged.parquet", "row 500 has 7 values, not 8"))
    save_file({"keys": keys, "rows": rows}, str(tmp_path / "names.safetensors"))
    cases.append(("names.safetensors", "lacks the tensor"))
    (tmp_path / "model.txt").write_text("hello")
    cases.append(("model.txt", "none of"))
    for name, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            list(open_rows(tmp_path / name).batches(256))


def test_verify_names_the_first_row_that_is_not_finite(tmp_path: Path) -> None:
    keys, rows = synthesize_model(5_000, 4, seed=8)
    rows[3_210, 1] = np.inf
    np.savez(tmp_path / "inf.npz", keys=keys, vectors=rows)
    with pytest.raises(InvalidArgumentError, match="row 3210 has NaN or inf"):
        verify(open_rows(tmp_path / "inf.npz"), batch_rows=1_000)
