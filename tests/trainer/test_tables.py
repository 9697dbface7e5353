"""The trainer's int64-keyed tables: the key index, server-default initial rows, row-wise Adagrad, eviction."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hps_service.config import TableConfig
from hps_service.engine.defaults import default_rows
from hps_service.errors import InvalidArgumentError
from hps_service.trainer.keyindex import KeyIndex
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.tables import EmbeddingTable


def test_key_index_agrees_with_a_dict_through_inserts_and_removals() -> None:
    rng = np.random.default_rng(0)
    index, reference = KeyIndex(8), {}
    next_slot = 0
    for _ in range(60):
        keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=50, dtype=np.int64) % 997 * (2**52 + 1))
        found = index.find(keys)
        assert found.tolist() == [reference.get(int(k), -1) for k in keys]
        new = keys[found < 0]
        slots = np.arange(next_slot, next_slot + new.size, dtype=np.int32)
        next_slot += new.size
        index.insert(new, slots)
        reference.update(zip(new.tolist(), slots.tolist()))
        gone = rng.choice(np.array(list(reference)), size=min(20, len(reference)), replace=False)
        index.remove(gone)
        for k in gone.tolist():
            del reference[k]
        assert index.count == len(reference)
    everything = np.array(list(reference), dtype=np.int64)
    assert index.find(everything).tolist() == list(reference.values())


def test_new_rows_are_exactly_the_servers_hashed_random_default() -> None:
    table = EmbeddingTable("t", 16, max_rows=100)
    keys = np.array([-(2**63), -1, 0, 7, 2**63 - 1], dtype=np.int64)
    served_default = default_rows(TableConfig(name="t", dim=16, default="hashed_random").default, keys, 16)
    assert np.array_equal(table.read(keys), served_default)  # not held yet: read as the default
    slots, rows = table.fetch_for_training(keys, step=1)
    assert np.array_equal(rows, served_default) and table.rows == 5
    assert np.array_equal(table.read(keys[::-1]), served_default[::-1])


def test_row_wise_adagrad_moves_only_the_given_rows_by_the_formula() -> None:
    table = EmbeddingTable("t", 3, max_rows=10, lr=0.1)
    keys = np.array([11, 22, 33], dtype=np.int64)
    slots, before = table.fetch_for_training(keys, step=0)
    grads = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    table.apply_gradients(slots[:2], grads[:2])
    after = table.read(keys)
    for i in range(2):
        g = grads[i]
        expected = torch.from_numpy(before[i]) - 0.1 * g / (g.pow(2).mean().sqrt() + 1e-8)
        torch.testing.assert_close(torch.from_numpy(after[i]), expected)
    assert np.array_equal(after[2], before[2])
    table.apply_gradients(slots[:1], grads[:1])  # the accumulator adds up: a second step is smaller
    second = table.read(keys[:1])[0] - after[0]
    g = grads[0]
    torch.testing.assert_close(torch.from_numpy(second), -0.1 * g / (2 * g.pow(2).mean()).sqrt(), rtol=1e-5,
                               atol=1e-7)


def test_full_tables_evict_the_coldest_rows_and_queue_deletes_for_published_ones() -> None:
    table = EmbeddingTable("t", 4, max_rows=64)
    store = LatestRowStore({"t": 4})
    for step in range(4):  # 4 x 16 keys: full
        table.fetch_for_training(np.arange(step * 16, (step + 1) * 16, dtype=np.int64), step=step)
    deletes, keys, rows = table.take_changes()
    assert deletes.size == 0 and keys.size == 64
    store.publish("t", keys, rows, version=10)
    table.fetch_for_training(np.arange(0, 8, dtype=np.int64), step=10)  # 0..7 are warm again
    table.fetch_for_training(np.arange(1000, 1010, dtype=np.int64), step=11)  # 10 new keys need room
    assert table.rows <= 64 and table.evictions >= 10
    evicted = np.setdiff1d(np.arange(64), np.flatnonzero(table.index.find(np.arange(64)) >= 0))
    assert evicted.size == table.evictions == 10 + 64 // 64  # room for the batch, plus 1/64 headroom
    assert set(evicted.tolist()) >= set(range(8, 16)) and evicted.max() < 32  # step 0's cold rows, then step 1's
    deletes, keys, rows = table.take_changes()
    assert np.array_equal(np.sort(deletes), evicted)
    store.delete("t", deletes, version=11)
    store.publish("t", keys, rows, version=11)
    every = np.concatenate([np.arange(64), np.arange(1000, 1010)])
    assert np.array_equal(store.lookup("t", every), table.read(every))  # the served view equals the trainer's
    table.fetch_for_training(evicted[:3], step=12)  # evicted and created again: published, not deleted
    deletes, keys, _ = table.take_changes()
    assert not np.isin(evicted[:3], deletes).any() and np.isin(evicted[:3], keys).all()
    with pytest.raises(InvalidArgumentError, match="max-rows-per-table"):
        table.fetch_for_training(np.arange(5000, 5100, dtype=np.int64), step=13)


def test_state_round_trips_and_can_be_split_by_owner() -> None:
    table = EmbeddingTable("t", 2, max_rows=100)
    slots, _ = table.fetch_for_training(np.arange(20, dtype=np.int64) * 3, step=5)
    table.apply_gradients(slots, torch.ones(20, 2))
    state = table.state()
    copy = EmbeddingTable("t", 2, max_rows=100)
    copy.load_state(state)
    keys = np.arange(60, dtype=np.int64)
    assert np.array_equal(copy.read(keys), table.read(keys))
    assert np.array_equal(copy.accum.numpy()[copy.index.find(state["keys"])], state["accum"])
    even = EmbeddingTable("t", 2, max_rows=100)
    mask = state["keys"] % 2 == 0
    even.load_state({k: v[mask] if v.shape[:1] == mask.shape else v for k, v in state.items()})
    assert even.rows == int(mask.sum())


def test_a_checkpoint_written_by_two_ranks_loads_on_one_or_three(tmp_path) -> None:
    from hps_service.trainer.checkpoint import load_tables, write_tables
    from hps_service.updates.partitioning import partition_of

    keys = np.arange(500, dtype=np.int64) * 7919 - 10**6
    source = EmbeddingTable("t", 4, max_rows=1000)
    slots, _ = source.fetch_for_training(keys, step=3)
    source.apply_gradients(slots, torch.ones(keys.size, 4))
    for rank in range(2):  # what two ranks hold: the keys of their partitions
        shard = EmbeddingTable("t", 4, max_rows=1000)
        mine = keys[partition_of(keys, 24) % 2 == rank]
        shard.load_state({k: v[np.isin(source.state()["keys"], mine)] if k != "deletes" else v
                          for k, v in source.state().items()})
        write_tables(tmp_path, rank, {"t": shard})
    whole = EmbeddingTable("t", 4, max_rows=1000)
    load_tables(tmp_path, {"t": whole})
    assert np.array_equal(whole.read(keys), source.read(keys)) and whole.rows == 500
    parts = []
    for rank in range(3):
        table = EmbeddingTable("t", 4, max_rows=1000)
        load_tables(tmp_path, {"t": table}, lambda k, r=rank: partition_of(k, 24) % 3 == r)
        held = table.keys[table.live]
        assert (partition_of(held, 24) % 3 == rank).all()
        assert np.array_equal(table.read(held), source.read(held))
        parts.append(held)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(keys))
