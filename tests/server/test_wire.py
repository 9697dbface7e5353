"""The hand-written LookupResponse encoding is byte-for-byte what the protobuf runtime produces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.server.wire import ResponseBuffer, encode_lookup_response, varint


@settings(max_examples=150, deadline=None)
@given(
    model=st.text(max_size=20),
    request_id=st.integers(0, 2**64 - 1),
    tables=st.lists(
        st.tuples(st.text(max_size=12), st.integers(0, 40), st.integers(0, 9), st.integers(0, 2**32 - 1)), max_size=4
    ),
)
def test_matches_protobuf_serialization(model: str, request_id: int, tables: list) -> None:
    triples, messages = [], []
    for name, n, dim, seed in tables:
        rng = np.random.default_rng(seed)
        vectors = rng.standard_normal((n, dim)).astype(np.float32)
        sources = rng.integers(1, 5, n).astype(np.uint8)
        triples.append((name, vectors, sources))
        messages.append(pb.TableVectors(table=name, dim=dim, count=n, vectors=vectors.tobytes(),
                                        sources=sources.tobytes()))
    ours = encode_lookup_response(model, request_id, triples)
    theirs = pb.LookupResponse(model=model, tables=messages, request_id=request_id).SerializeToString()
    assert ours == theirs
    parsed = pb.LookupResponse.FromString(ours)
    assert parsed.model == model and parsed.request_id == request_id and len(parsed.tables) == len(tables)


def test_varint() -> None:
    assert varint(0) == b"\x00" and varint(1) == b"\x01" and varint(300) == b"\xac\x02"
    assert varint(2**64 - 1) == b"\xff" * 9 + b"\x01"


_BUFFER = ResponseBuffer()  # reused across examples, as a serving thread reuses its own


@settings(max_examples=150, deadline=None)
@given(model=st.text(max_size=20), table=st.text(max_size=12), request_id=st.integers(0, 2**64 - 1),
       n=st.integers(1, 300), dim=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_a_reused_buffer_written_in_place_matches_protobuf_serialization(
        model: str, table: str, request_id: int, n: int, dim: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    sources = rng.integers(1, 5, n).astype(np.uint8)
    rows, srcs = _BUFFER.layout(model, table, n, dim, request_id)
    assert rows.flags.c_contiguous and rows.flags.writeable and rows.ctypes.data % 64 == 0
    rows[:] = vectors
    srcs[:] = sources
    theirs = pb.LookupResponse(model=model, request_id=request_id, tables=[pb.TableVectors(
        table=table, dim=dim, count=n, vectors=vectors.tobytes(), sources=sources.tobytes())]).SerializeToString()
    assert _BUFFER.finish() == theirs == encode_lookup_response(model, request_id, [(table, vectors, sources)])
