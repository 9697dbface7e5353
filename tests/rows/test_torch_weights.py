"""Embedding weights as PyTorch saves them, imported: a TorchRec EBC's state_dict (``.pt``) and safetensors files
(written by the safetensors library: F32, F16, BF16, a keys tensor beside the rows, the keys/vectors layout) read
table by table, bad files refused naming why; ``hps import`` of a state_dict and the REST import of a safetensors
file, then served as saved."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hps_client import HPSClient  # noqa: E402
from hps_service.admin.importer import read_model_source  # noqa: E402
from hps_service.config import load_config  # noqa: E402
from hps_service.errors import InvalidArgumentError  # noqa: E402
from tests.helpers import free_port, run_hps, write_config  # noqa: E402
from tests.server.conftest import AUTH, TOKEN, running, wait_job  # noqa: E402


def _state_dict(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """What a DLRM's state_dict holds: TorchRec's EBC weights under the model's prefix, and dense layers."""
    prefix = "sparse_arch.embedding_bag_collection.embedding_bags"
    return {f"{prefix}.item.weight": torch.randn(50, 8, generator=gen),
            f"{prefix}.user.weight": torch.randn(30, 4, generator=gen),
            "dense_arch.model._mlp.0._linear.weight": torch.randn(4, 13, generator=gen)}


def test_state_dict_tables_are_read_by_name_row_index_as_key(tmp_path: Path) -> None:
    sd = _state_dict(torch.Generator().manual_seed(1))
    path = tmp_path / "dlrm.pt"
    torch.save({"model": sd, "step": 3}, path)  # nested: names joined with dots
    keys, rows = read_model_source(path, "item")
    np.testing.assert_array_equal(keys, np.arange(50))
    np.testing.assert_array_equal(rows, sd["sparse_arch.embedding_bag_collection.embedding_bags.item.weight"].numpy())
    ids = torch.tensor([10, 3, 99], dtype=torch.int64)
    torch.save({"user.weight": sd["sparse_arch.embedding_bag_collection.embedding_bags.user.weight"][:3]
                .to(torch.bfloat16), "user.keys": ids}, tmp_path / "user.pth")
    keys, rows = read_model_source(tmp_path / "user.pth", "user")
    np.testing.assert_array_equal(keys, ids.numpy())
    assert rows.dtype == np.float32 and rows.shape == (3, 4)


def test_safetensors_files_are_read_without_torch_in_every_float_width(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(20, 6, generator=gen)
    keys = torch.arange(1000, 1020, dtype=torch.int64)
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file({"embeddings.a.weight": w, "embeddings.a.keys": keys,
                                 "b": w.to(torch.float16), "c.weight": w.to(torch.bfloat16)}, str(path))
    got_keys, rows = read_model_source(path, "a")
    np.testing.assert_array_equal(got_keys, keys.numpy())
    np.testing.assert_array_equal(rows, w.numpy())
    np.testing.assert_array_equal(read_model_source(path, "b")[1], w.to(torch.float16).float().numpy())
    np.testing.assert_array_equal(read_model_source(path, "c")[1], w.to(torch.bfloat16).float().numpy())
    plain = tmp_path / "plain.safetensors"
    safetensors_torch.save_file({"keys": keys, "vectors": w}, str(plain))
    np.testing.assert_array_equal(read_model_source(plain, "anything")[0], keys.numpy())


def test_files_that_hold_no_such_table_or_no_state_dict_are_refused(tmp_path: Path) -> None:
    sd = _state_dict(torch.Generator().manual_seed(3))
    path = tmp_path / "dlrm.pt"
    torch.save(sd, path)
    with pytest.raises(InvalidArgumentError, match="holds no rows for embedding_bags.nope.weight.*it holds: "
                                                   "sparse_arch.embedding_bag_collection.embedding_bags.item.weight"):
        read_model_source(path, "nope")
    torch.save({"x.item.weight": sd["dense_arch.model._mlp.0._linear.weight"],
                "y.item.weight": sd["dense_arch.model._mlp.0._linear.weight"]}, tmp_path / "two.pt")
    with pytest.raises(InvalidArgumentError, match="several tensors for table 'item'"):
        read_model_source(tmp_path / "two.pt", "item")
    torch.save({"item.weight": torch.zeros(4, 2), "item.keys": torch.arange(3)}, tmp_path / "keys.pt")
    with pytest.raises(InvalidArgumentError, match="3 keys in item.keys but 4 rows"):
        read_model_source(tmp_path / "keys.pt", "item")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    with pytest.raises(InvalidArgumentError, match="not a readable torch state_dict"):
        read_model_source(tmp_path / "module.pt", "item")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(InvalidArgumentError, match="not a safetensors file"):
        read_model_source(tmp_path / "bad.safetensors", "item")
    torch.save({"item.weight": torch.tensor([[1.0, float("nan")]])}, tmp_path / "nan.pt")
    with pytest.raises(InvalidArgumentError, match="NaN or inf"):
        read_model_source(tmp_path / "nan.pt", "item")


def test_hps_import_and_the_rest_import_serve_the_saved_weights(tmp_path: Path) -> None:
    sd = _state_dict(torch.Generator().manual_seed(4))
    torch.save(sd, tmp_path / "dlrm.pt")
    user = sd["sparse_arch.embedding_bag_collection.embedding_bags.user.weight"]
    safetensors_torch.save_file({"embedding_bags.user.weight": user}, str(tmp_path / "user.safetensors"))
    http_port = free_port()
    cfg_path = write_config(tmp_path / "hps.yaml", {
        "server": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": http_port, "admin_token": TOKEN},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "dlrm", "tables": [{"name": "item", "dim": 8}, {"name": "user", "dim": 4}]}],
    })
    done = run_hps("import", str(tmp_path / "dlrm.pt"), "--config", str(cfg_path), "--model", "dlrm", "--table",
                   "item")
    assert done.returncode == 0, done.stderr
    assert "imported 50 rows (dim 8)" in done.stdout
    wrong = run_hps("import", str(tmp_path / "user.safetensors"), "--config", str(cfg_path), "--model", "dlrm",
                    "--table", "item")
    assert wrong.returncode != 0 and "holds no rows for embedding_bags.item.weight" in wrong.stderr, wrong.stderr
    with running(load_config(cfg_path)) as srv, HPSClient(f"127.0.0.1:{srv.grpc_port}") as client, \
            httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", headers=AUTH, timeout=30) as http:
        np.testing.assert_array_equal(client.lookup("dlrm", "item", np.arange(50)),
                                      sd["sparse_arch.embedding_bag_collection.embedding_bags.item.weight"].numpy())
        r = http.post("/v1/models/dlrm/tables/user/import", json={"path": str(tmp_path / "user.safetensors")})
        assert r.status_code == 202, r.text
        job = wait_job(http, r.json()["id"])
        assert job["state"] == "succeeded", job
        np.testing.assert_array_equal(client.lookup("dlrm", "user", np.arange(30)), user.numpy())
