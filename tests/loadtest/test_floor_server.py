"""The transport floors answer the canned response, byte for byte, whichever server sends it: grpcio's thread pool
and pygrpc-native's front (the second floor of ``make bench`` part 2), one process and several sharing the port."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from hps_service.proto.hps.v1 import embedding_pb2 as pb
from loadtest.harness.drivers import LOOKUP_METHOD
from loadtest.harness.floor_server import FloorServer, fixed_response


@pytest.mark.parametrize(("mode", "processes"), [("sync", 1), ("native", 1), ("native", 2)])
def test_a_floor_answers_the_canned_response(tmp_path: Path, mode: str, processes: int) -> None:
    if mode == "native":
        pytest.importorskip("pygrpc_native")
    request = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=np.arange(64, dtype="<i8")
                                                                  .tobytes())]).SerializeToString()
    with FloorServer(mode, 64, tmp_path, processes=processes, threads=2, dim=8) as floor, \
            grpc.insecure_channel(floor.target) as channel:
        lookup = channel.unary_unary(LOOKUP_METHOD)
        for _ in range(4):
            assert lookup(request, timeout=10) == fixed_response("demo", ["item"], 64, 8)
