"""The client's side of pooled lookups, against the server's pooling kernel as the reference: an answer of one row
per key (a server from before pooled lookups) is pooled by the client as the server would pool it, and a bag split
over shards (each summing its share) adds back up to the whole bag's sum or mean."""

from __future__ import annotations

import numpy as np
import pytest

from hps_client.bags import Pooling, add_parts, answers_of, pool, pooling_of, shard_pooling
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.wire import TableAnswer
from tests.engine.test_bags import reference


def _case(seed: int, combiner: str) -> tuple[np.ndarray, np.ndarray, Pooling]:
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(5, 30)
    lengths[::6] = 0
    n = int(lengths.sum())
    rows = rng.standard_normal((n, 4)).astype(np.float32)
    sources = rng.integers(1, 5, n).astype(np.uint8)
    weights = rng.standard_normal(n).astype(np.float32) if combiner == "sum" else None
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return rows, sources, pooling_of(offsets, combiner, weights)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_an_answer_of_one_row_per_key_is_pooled_as_the_server_pools(combiner: str) -> None:
    rows, sources, pooling = _case(1, combiner)
    want, deepest = reference(rows, sources, pooling.offsets, int(pooling.combiner), pooling.weights)
    per_key = pb.TableVectors(table="t", dim=4, count=rows.shape[0], vectors=rows.tobytes(), sources=sources.tobytes())
    got = answers_of([per_key], False, {"t": pooling})["t"]
    np.testing.assert_allclose(got.vectors, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.sources, deepest)
    pooled = pb.TableVectors(table="t", dim=4, count=2, vectors=want[:2].tobytes(), sources=deepest[:2].tobytes(),
                             pooled=True)
    assert answers_of([pooled], False, {"t": pooling})["t"].vectors.shape == (2, 4)  # a server's pooling kept


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_bags_split_over_shards_add_back_to_the_whole(combiner: str) -> None:
    rows, sources, pooling = _case(2, combiner)
    n = rows.shape[0]
    shard = np.random.default_rng(3).integers(0, 3, n)
    parts = []
    for s in range(3):
        share = shard_pooling(pooling, n, shard == s)
        parts.append(pool(TableAnswer(rows[shard == s], sources[shard == s]), share))
    got = add_parts(parts, pooling, n)
    want, deepest = reference(rows, sources, pooling.offsets, int(pooling.combiner), pooling.weights)
    np.testing.assert_allclose(got.vectors, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.sources, deepest)
