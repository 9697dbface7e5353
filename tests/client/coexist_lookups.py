"""The lookups of hps-client, run by tests/client/test_coexistence.py inside a virtualenv that holds hps-client beside
another inference package (or at its dependency floors): the neighbour's gRPC stubs are loaded into the same process
first (one protobuf runtime, one descriptor pool), then hps-client's stubs with every warning an error, then lookups
against a live server. Prints one JSON line of results.

    python coexist_lookups.py TARGET NEIGHBOUR [--full-import]

NEIGHBOUR is tritonclient, tensorflow-serving-api, feast or none. Without ``--full-import`` the neighbour's package
``__init__`` is not run (tensorflow's and feast's take tens of seconds): its stub modules are loaded from its
directory, as its own imports would load them.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import types
import warnings

#: The neighbour's top-level package whose ``__init__`` may be skipped, and its gRPC stub modules.
NEIGHBOURS = {
    "tritonclient": ("tritonclient", ["tritonclient.grpc.service_pb2_grpc"]),
    "tensorflow-serving-api": ("tensorflow", ["tensorflow_serving.apis.prediction_service_pb2_grpc",
                                              "tensorflow_serving.apis.model_service_pb2_grpc"]),
    "feast": ("feast", ["feast.protos.feast.serving.ServingService_pb2_grpc"]),
    "none": (None, []),
}


def load_neighbour(name: str, full: bool) -> list[str]:
    package, modules = NEIGHBOURS[name]
    if package is not None and not full:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
        shell = types.ModuleType(package)  # the package without its __init__: its submodules import as usual
        shell.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = shell
    for module in modules:
        importlib.import_module(module)
    return modules


def main() -> None:
    target, neighbour = sys.argv[1], sys.argv[2]
    loaded = load_neighbour(neighbour, "--full-import" in sys.argv)
    warnings.simplefilter("error")  # a protobuf or grpcio version warning from our stubs fails the run
    import numpy as np

    from hps_client import AsyncHPSClient, HPSClient, NotFoundError
    from hps_client.proto.hps.v1 import embedding_pb2, embedding_pb2_grpc, update_pb2  # noqa: F401

    keys = np.arange(100, 140, dtype=np.int64)
    with HPSClient(target, timeout=30) as client:
        got = client.lookup_with_sources("demo", "item", np.concatenate([keys, [7]]))
        many = client.lookup_many("demo", {"item": keys[:3]})
        try:
            client.lookup("demo", "nope", [1])
            raise SystemExit("no error for an unknown table")
        except NotFoundError as exc:
            error = [exc.code.name, exc.details]

    async def aio() -> list:
        async with AsyncHPSClient(target, timeout=30) as client:
            return (await client.lookup("demo", "item", keys[:2])).tolist()

    versions = {p: importlib.metadata.version(p) for p in ("protobuf", "grpcio", "numpy", "hps-client")}
    print(json.dumps({"rows": got.vectors.tolist(), "sources": got.sources.tolist(), "many": many["item"].vectors.tolist(),
                      "aio": asyncio.run(aio()), "error": error, "versions": versions, "loaded": loaded}))


if __name__ == "__main__":
    main()
