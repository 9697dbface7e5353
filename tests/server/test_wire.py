"""The hand-written LookupResponse encoding is byte-for-byte what the protobuf runtime produces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hps_client.rows import STORAGE_CODES
from hps_client.wire import decode_stored, parse_lookup_response
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import rows_pb2
from hps_service.rows import STORAGES, row_format
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


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from(["m", "model"]), st.sampled_from(["t", ""]), st.integers(0, 2),
                                 st.integers(1, 40), st.sampled_from([4, 8]), st.integers(0, 2)), min_size=2,
                       max_size=8),
       seed=st.integers(0, 2**32 - 1))
def test_a_call_of_the_last_calls_shape_reuses_its_layout_and_still_matches(shapes: list, seed: int) -> None:
    """Calls of one shape in a row take the laid-out views as they are (the headers are still in place); every
    answer still matches protobuf's, whatever shape came before."""
    buf, rng = ResponseBuffer(), np.random.default_rng(seed)
    for model, table, request_id, n, dim, version in shapes + shapes[::-1] + shapes:
        vectors = rng.standard_normal((n, dim)).astype(np.float32)
        sources = rng.integers(1, 6, n).astype(np.uint8)
        rows, srcs = buf.layout(model, table, n, dim, request_id, version=version)
        rows[:] = vectors
        srcs[:] = sources
        theirs = pb.LookupResponse(model=model, request_id=request_id, version=version, tables=[pb.TableVectors(
            table=table, dim=dim, count=n, vectors=vectors.tobytes(), sources=sources.tobytes())])
        assert buf.finish() == theirs.SerializeToString()


@settings(max_examples=100, deadline=None)
@given(request_id=st.integers(0, 2**64 - 1), n=st.integers(1, 60), dim=st.integers(1, 20),
       storage=st.sampled_from(["fp32", "fp16", "bf16", "int8"]), seed=st.integers(0, 2**32 - 1))
def test_stored_rows_match_protobuf_serialization(request_id: int, n: int, dim: int, storage: str, seed: int) -> None:
    """A precision = stored answer: the rows' words and the storage field, in the buffer and the general encoder."""
    fmt = row_format(storage, dim)
    rng = np.random.default_rng(seed)
    words = fmt.encode(rng.standard_normal((n, dim)).astype(np.float32))
    sources = rng.integers(1, 5, n).astype(np.uint8)
    code = STORAGE_CODES[storage]
    rows, srcs = _BUFFER.layout("m", "t", n, dim, request_id, fmt.words, code)
    assert rows.shape == (n, fmt.words)
    rows[:] = words
    srcs[:] = sources
    theirs = pb.LookupResponse(model="m", request_id=request_id, tables=[pb.TableVectors(
        table="t", dim=dim, count=n, vectors=words.tobytes(), sources=sources.tobytes(),
        storage=code)]).SerializeToString()
    assert _BUFFER.finish() == theirs == encode_lookup_response("m", request_id, [("t", words, sources)],
                                                                [(dim, code)])
    parsed = parse_lookup_response(theirs).tables[0]
    answer = decode_stored(parsed)
    assert answer.rows.storage == storage and answer.rows.nbytes == 4 * n * fmt.words
    np.testing.assert_array_equal(answer.rows.to_float32(), fmt.decoded(words))


def test_the_client_knows_every_row_storage_of_the_proto() -> None:
    assert {name: rows_pb2.RowStorage.Value(f"ROW_STORAGE_{name.upper()}") for name in STORAGES} == STORAGE_CODES
    assert set(STORAGE_CODES.values()) == set(rows_pb2.RowStorage.values())
