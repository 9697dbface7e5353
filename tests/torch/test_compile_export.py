"""A small model holding both modules compiles with ``torch.compile(fullgraph=True)`` and exports with
``torch.export``: each lookup is one opaque ``torch.ops.hps`` node, the compiled and the loaded programs answer what
the eager model does, and a prefetch still hands its rows to the compiled forward."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from hps_client.torch import HPSEmbedding, HPSEmbeddingBag  # noqa: E402
from tests.torch.conftest import Served  # noqa: E402


class Small(nn.Module):
    """A user's embedding per id and a pooled history bag, then a dense layer."""

    def __init__(self, client: object) -> None:
        super().__init__()
        self.user = HPSEmbedding(client, "m", "c")
        self.history = HPSEmbeddingBag(client, "m", "a", mode="mean")
        self.dense = nn.Linear(4 + 8, 1)

    def forward(self, users: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.dense(torch.cat([self.user(users), self.history(history)], dim=1)))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 600, (16,), generator=gen), torch.randint(0, 1000, (16, 5), generator=gen)


def test_compiled_fullgraph_answers_what_eager_does(served: Served) -> None:
    torch.manual_seed(0)
    model = Small(served.grpc).eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for seed in (1, 2):
            users, history = _batch(seed)
            torch.testing.assert_close(compiled(users, history), model(users, history), rtol=1e-5, atol=1e-6)
        users, history = _batch(3)
        handle = model.history.prefetch(history)
        torch.testing.assert_close(compiled(users, history), model(users, history), rtol=1e-5, atol=1e-6)
        assert handle.consumed


def test_exported_program_saves_loads_and_answers_what_eager_does(served: Served, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Small(served.grpc).eval()
    users, history = _batch(4)
    program = torch.export.export(model, (users, history))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"hps.embedding.default", "hps.embedding_bag.default"} <= targets
    path = tmp_path / "small.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    with torch.no_grad():
        want = model(users, history)
    torch.testing.assert_close(loaded(users, history), want, rtol=1e-5, atol=1e-6)
    # in a process of its own: the modules built again over a client of the same target bind what the program names
    script = textwrap.dedent(f"""
        import json, torch
        from hps_client import HPSClient
        from hps_client.torch import HPSEmbedding, HPSEmbeddingBag
        client = HPSClient({served.srv.target!r})
        HPSEmbedding(client, "m", "c"), HPSEmbeddingBag(client, "m", "a", mode="mean")
        users, history = torch.tensor({users.tolist()}), torch.tensor({history.tolist()})
        print(json.dumps(torch.export.load({str(path)!r}).module()(users, history).tolist()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(json.loads(out.stdout)), want, rtol=1e-5, atol=1e-6)
