"""A PyTorch model served by Triton Inference Server (through PyTriton) whose embedding lookup goes to hps-service
through ``HPSEmbeddingBag``: each request's rows of history ids are pooled (mean) by the server, and the model
answers the pooled row and a score.

    python examples/triton_hps.py --hps-target 127.0.0.1:8500 --model demo --table item --http-port 8010

Model ``ranker``: input ``history`` (int64, a fixed number of ids per row), outputs ``pooled`` (float32, dim) and
``score`` (float32, 1: the sigmoid of the pooled row's sum). Needs ``nvidia-pytriton`` and ``hps-client[torch]`` in
an environment of their own (PyTriton pins NumPy below 2 and protobuf 6), on the system's Python: PyTriton's Python
backend stub loads the system's ``libpython3.11``, whose standard library must be the interpreter's (a pyenv
3.11.7 beside Debian's 3.11.2 fails in ``multiprocessing.resource_tracker``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from hps_client import HPSClient
from hps_client.torch import HPSEmbeddingBag


class Ranker(torch.nn.Module):
    """The served table's mean of each row's history, and a score of it."""

    def __init__(self, client: HPSClient, model: str, table: str) -> None:
        super().__init__()
        self.history = HPSEmbeddingBag(client, model, table, mode="mean")

    def forward(self, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.history(history)
        return pooled, torch.sigmoid(pooled.sum(dim=1, keepdim=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hps-target", required=True, help="hps serve's gRPC address (or local:///dev/shm/hps)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--http-port", type=int, default=8010)
    ap.add_argument("--grpc-port", type=int, default=8011)
    ap.add_argument("--metrics-port", type=int, default=8012)
    args = ap.parse_args(argv)
    client = HPSClient(args.hps_target, timeout=10)
    ranker = Ranker(client, args.model, args.table).eval()

    @batch
    def infer(history: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            pooled, score = ranker(torch.from_numpy(history))
        return {"pooled": pooled.numpy(), "score": score.numpy()}

    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, exit_timeout_secs=5)
    with Triton(config=config) as triton:
        triton.bind(model_name="ranker", infer_func=infer,
                    inputs=[Tensor(name="history", dtype=np.int64, shape=(-1,))],
                    outputs=[Tensor(name="pooled", dtype=np.float32, shape=(ranker.history.embedding_dim,)),
                             Tensor(name="score", dtype=np.float32, shape=(1,))],
                    config=ModelConfig(max_batch_size=256))
        print(f"serving model ranker on 127.0.0.1:{args.http_port} (HTTP) and :{args.grpc_port} (gRPC)", flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
