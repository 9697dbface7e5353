"""The RocksDB tier's tuned options, for the DB and for each column family alike (rocksdict forgets table options
that are not passed per column family when it reopens a store)."""

from __future__ import annotations

from rocksdict import BlockBasedOptions, Cache, DataBlockIndexType, Options

from hps_service.tiers.rocksdb.flush import NEVER_BYTES


def tuned_options(block_cache: Cache | None, row_cache: Cache | None, write_buffer_bytes: int,
                  max_total_wal_bytes: int, pin: bool = False) -> Options:
    """Options of a store with ``block_cache`` and ``row_cache`` (None: none) whose flush policy switches memtables
    at ``write_buffer_bytes`` and the logs at ``max_total_wal_bytes``; ``pin``: the DB's and its ``default`` column
    family's, which only the flush policy's pin writes."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    table = BlockBasedOptions()
    if block_cache is not None:
        table.set_block_cache(block_cache)
    else:
        table.disable_cache()
    table.set_bloom_filter(10, False)
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    table.set_data_block_index_type(DataBlockIndexType.binary_and_hash())
    table.set_data_block_hash_ratio(0.75)
    opts.set_block_based_table_factory(table)
    if row_cache is not None:
        opts.set_row_cache(row_cache)
    opts.set_level_compaction_dynamic_level_bytes(True)
    # Memtable switches are this tier's to make (``persistent.write_buffer_mb``, ``max_total_wal_mb``; see
    # tiers/rocksdb/flush.py): RocksDB's own would leave a secondary instance answering from before a flush. Its
    # limits are set above the policy's (a table's at twice, which only a batch larger than the memtable crosses;
    # the pin's above the logs' bound, which it never reaches) and the log bound out of reach.
    opts.set_write_buffer_size(max(2 * write_buffer_bytes, 2 * max_total_wal_bytes if pin else 0))
    opts.set_max_total_wal_size(NEVER_BYTES)
    # A bloom filter over the memtable's keys (2% of ``write_buffer_mb``; RocksDB sizes it on its own limit,
    # twice that): the update path reads the stored version of every key it writes, and most are not in the
    # memtable, so they skip its skiplist search (measured with loadtest.probes.rocksdb_ingest: multi-get 22% and
    # the versioned put 12% less CPU at 1M rows). The pin is never read.
    opts.set_memtable_whole_key_filtering(not pin)
    opts.set_memtable_prefix_bloom_ratio(0.0 if pin else 0.01)
    return opts
