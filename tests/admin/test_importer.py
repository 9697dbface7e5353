"""Model import from HugeCTR directories and .npz files into a real RocksDB tier, with validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.admin.importer import import_table, read_model_source, synthesize_model, write_hugectr_dir
from hps_service.errors import InvalidArgumentError
from hps_service.tiers.rocksdb.tier import RocksDBTier


@pytest.fixture
def tier(tmp_path: Path):
    t = RocksDBTier(tmp_path / "db", block_cache_mb=8)
    yield t
    t.close()


def test_synthesize_model_is_deterministic_unique_and_shuffled() -> None:
    keys, vecs = synthesize_model(1000, 16, seed=7)
    again_keys, again_vecs = synthesize_model(1000, 16, seed=7)
    np.testing.assert_array_equal(keys, again_keys)
    np.testing.assert_array_equal(vecs, again_vecs)
    assert keys.dtype == np.int64 and vecs.dtype == np.float32 and vecs.shape == (1000, 16)
    assert np.unique(keys).size == 1000
    assert not np.all(np.diff(keys) > 0)  # shuffled
    assert np.diff(np.sort(keys)).max() > 1  # not a contiguous range
    other, _ = synthesize_model(1000, 16, seed=8)
    assert not np.array_equal(keys, other)


@pytest.mark.parametrize("fmt", ["hugectr", "npz"])
def test_import_both_formats_with_duplicates(tier: RocksDBTier, tmp_path: Path, fmt: str) -> None:
    keys, vecs = synthesize_model(500, 8, seed=1)
    keys = np.concatenate([keys, keys[:20]])
    vecs = np.concatenate([vecs, vecs[:20] + 1.0])  # duplicates: the later rows win
    if fmt == "hugectr":
        src = tmp_path / "model"
        write_hugectr_dir(src, keys, vecs)
    else:
        src = tmp_path / "model.npz"
        np.savez(src, keys=keys, vectors=vecs)
    read_keys, read_vecs = read_model_source(src)
    np.testing.assert_array_equal(read_keys, keys)
    np.testing.assert_array_equal(read_vecs, vecs)
    progress: list[int] = []
    written = import_table(tier, "demo.item", 8, read_keys, read_vecs, version=2, progress=progress.append)
    assert written == 500
    assert progress[-1] == 500
    rows = tier.get("demo.item", keys[:500])
    assert rows.found.all() and (rows.versions == 2).all()
    np.testing.assert_array_equal(rows.vectors[:20], vecs[:20] + 1.0)
    np.testing.assert_array_equal(rows.vectors[20:], vecs[20:500])
    assert tier.count("demo.item") == 500


def test_dim_mismatch_writes_nothing(tier: RocksDBTier, tmp_path: Path) -> None:
    keys, vecs = synthesize_model(50, 32, seed=2)
    write_hugectr_dir(tmp_path / "model", keys, vecs)
    with pytest.raises(InvalidArgumentError, match="table demo.item has dim 64 but the file has dim 32"):
        import_table(tier, "demo.item", 64, *read_model_source(tmp_path / "model"))
    assert "demo.item" not in tier.tables()


def test_bad_file_writes_nothing(tier: RocksDBTier, tmp_path: Path) -> None:
    tier.create_table("demo.item", 4)
    keys, vecs = synthesize_model(100, 4, seed=3)
    vecs[60, 1] = np.inf
    np.savez(tmp_path / "bad.npz", keys=keys, vectors=vecs)
    with pytest.raises(InvalidArgumentError, match="row 60 .*NaN or inf"):
        read_model_source(tmp_path / "bad.npz")
    with pytest.raises(InvalidArgumentError, match="NaN or inf"):
        import_table(tier, "demo.item", 4, keys, vecs)
    assert not tier.get("demo.item", keys).found.any()
    assert tier.count("demo.item") == 0


def _hugectr(path: Path, key_bytes: bytes, vec_bytes: bytes) -> Path:
    path.mkdir()
    (path / "key").write_bytes(key_bytes)
    (path / "emb_vector").write_bytes(vec_bytes)
    return path


def test_validation_messages(tmp_path: Path) -> None:
    cases: list[tuple[Path, str]] = []
    cases.append((tmp_path / "absent", "does not exist"))
    only_keys = tmp_path / "only_keys"
    only_keys.mkdir()
    (only_keys / "key").write_bytes(np.arange(3, dtype="<i8").tobytes())
    cases.append((only_keys, "missing file emb_vector"))
    cases.append((_hugectr(tmp_path / "odd_keys", b"\0" * 12, b"\0" * 16), "not a multiple of 8"))
    cases.append((_hugectr(tmp_path / "odd_vecs", b"\0" * 16, b"\0" * 12), "not a multiple of 2 keys x 4"))
    cases.append((_hugectr(tmp_path / "empty", b"", b""), "empty model"))
    nan_vecs = np.zeros((2, 3), dtype="<f4")
    nan_vecs[1, 0] = np.nan
    cases.append(
        (_hugectr(tmp_path / "nan", np.arange(2, dtype="<i8").tobytes(), nan_vecs.tobytes()), "row 1")
    )
    np.savez(tmp_path / "count.npz", keys=np.arange(3), vectors=np.zeros((2, 4), np.float32))
    cases.append((tmp_path / "count.npz", "3 keys but 2 vectors"))
    np.savez(tmp_path / "flat.npz", keys=np.arange(3), vectors=np.zeros(3, np.float32))
    cases.append((tmp_path / "flat.npz", "must be 2-D"))
    np.savez(tmp_path / "nokeys.npz", vectors=np.zeros((2, 4), np.float32))
    cases.append((tmp_path / "nokeys.npz", "lacks array"))
    np.savez(tmp_path / "empty.npz", keys=np.zeros(0, np.int64), vectors=np.zeros((0, 4), np.float32))
    cases.append((tmp_path / "empty.npz", "empty model"))
    (tmp_path / "model.txt").write_text("hello")
    cases.append((tmp_path / "model.txt", "neither"))
    for path, message in cases:
        with pytest.raises(InvalidArgumentError, match=message) as err:
            read_model_source(path)
        assert "\n" not in str(err.value)


def test_hugectr_source_is_memory_mapped(tmp_path: Path) -> None:
    keys, vecs = synthesize_model(64, 4, seed=4)
    write_hugectr_dir(tmp_path / "model", keys, vecs)
    read_keys, read_vecs = read_model_source(tmp_path / "model")
    assert isinstance(read_keys, np.memmap) and isinstance(read_vecs.base, np.memmap)
    assert read_vecs.shape == (64, 4)
