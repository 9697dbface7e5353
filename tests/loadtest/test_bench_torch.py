"""``loadtest.benchmarks.torch_dlrm`` (make bench part 16) runs end to end on small tables and batches: the served collections
answer what TorchRec's does (the bench checks it before timing), every contender and prefetch mode is timed, and the
table shows each row."""

from __future__ import annotations

import pytest
from rich.console import Console

pytest.importorskip("torchrec")

from loadtest.benchmarks import torch_dlrm  # noqa: E402


def test_the_pytorch_bench_times_every_contender(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_dlrm, "BATCH", 64)  # 64 x 4 bags of 4 ids: the same steps, smaller
    monkeypatch.setattr(torch_dlrm, "FEATURES", 4)
    monkeypatch.setattr(torch_dlrm, "MEAN_BAG", 4)
    out = torch_dlrm.bench(500, 1.0, Console(file=open("/dev/null", "w")))  # noqa: SIM115
    assert set(out["ms"]) == {"torchrec", "grpc", "local", "dlrm_torchrec", "dlrm_local"}
    assert all(ms > 0 for ms in out["ms"].values())
    assert out["hit_fraction"] == 1.0 and out["torch_threads"] == 1
    assert len(out["prefetch"]) == 4 and all(p["lookup_ms"] > 0 for p in out["prefetch"].values())
    console = Console(record=True, width=250, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(torch_dlrm.table(out))
    text = console.export_text()
    assert "over LocalClient (colocated) vs TorchRec's EBC" in text and "prefetch over local, dense on the cpu" in text
