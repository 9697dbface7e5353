"""The client's LookupResponse parser reads what protobuf reads (pinned against the generated message on the same
bytes), keeps the rows as views of the received bytes, and refuses malformed bytes with ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.wire import decode_answer, parse_lookup_response


def _response(rng: np.random.Generator, tables: int) -> pb.LookupResponse:
    out = pb.LookupResponse(model="ctr-" + "m" * int(rng.integers(0, 40)), request_id=int(rng.integers(0, 2**63)))
    for t in range(tables):
        n, dim = int(rng.integers(0, 300)), int(rng.integers(1, 130))
        out.tables.append(pb.TableVectors(
            table=f"tab{t}é", dim=dim, count=n, vectors=rng.standard_normal((n, dim), dtype=np.float32).tobytes(),
            sources=rng.integers(1, 5, n, dtype=np.uint8).tobytes()))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_it_reads_what_protobuf_reads(seed: int) -> None:
    rng = np.random.default_rng(seed)
    message = _response(rng, int(rng.integers(0, 4)))
    data = message.SerializeToString()
    got = parse_lookup_response(data)
    assert (got.model, got.request_id, len(got.tables)) == (message.model, message.request_id, len(message.tables))
    for tv, want in zip(got.tables, message.tables):
        assert (tv.table, tv.dim, tv.count) == (want.table, want.dim, want.count)
        a, b = decode_answer(tv), decode_answer(want)
        np.testing.assert_array_equal(a.vectors, b.vectors)
        np.testing.assert_array_equal(a.sources, b.sources)
        assert a.vectors.base is not None and not a.vectors.flags.owndata  # a view of the received bytes


def test_unknown_fields_are_skipped_and_the_last_scalar_wins() -> None:
    known = pb.LookupResponse(model="m", tables=[pb.TableVectors(table="t", dim=1, count=1, vectors=b"\0\0\x80?",
                                                                 sources=b"\x01")], request_id=5)
    # field 9 of each wire type (varint, fixed64, bytes, fixed32), then request_id again
    extra = b"\x48\x96\x01" + b"\x49" + bytes(8) + b"\x4a\x03abc" + b"\x4d" + bytes(4) + b"\x18\x07"
    got = parse_lookup_response(known.SerializeToString() + extra)
    assert got.request_id == pb.LookupResponse.FromString(known.SerializeToString() + extra).request_id == 7
    assert got.tables[0].table == "t" and decode_answer(got.tables[0]).vectors.tolist() == [[1.0]]


@pytest.mark.parametrize("data, why", [
    (b"\x12\x05\x0a\x01", "past its message"),                        # a table longer than the bytes
    (b"\x18\xff\xff", "varint"),                                       # a truncated varint
    (b"\x18" + b"\xff" * 10 + b"\x01", "varint"),                      # a varint longer than 10 bytes
    (b"\x13", "wire type 3"),                                          # a group: not in a LookupResponse
    (pb.LookupResponse(tables=[pb.TableVectors(table="t", dim=2, count=2, vectors=bytes(12),
                                               sources=b"\x01\x01")]).SerializeToString(), "12 bytes of vectors"),
])
def test_malformed_bytes_are_a_value_error_naming_the_problem(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_lookup_response(data)
