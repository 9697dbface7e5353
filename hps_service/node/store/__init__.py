"""The node's shared store: the arrays of L1 and the hash-map tier, the counters and the queues, as files of one
memory-backed directory that every process of the node maps.

One process (the owner) creates and writes it; the gRPC worker processes and colocated readers
(:class:`hps_service.local.LocalClient`) attach to it and read it without locks (sequence locks, see
``tiers/_hashmap_kernels.read_rows`` and ``cache/cpu_kernels.query_kernel``). Modules: ``region`` (named array
files), ``layout`` (the header and a generation's directory), ``manifest`` (what is where), ``counters``
(per-process, per-thread counters the owner sums), ``queue`` (single-producer rings from a worker to the owner),
``changes`` (keys recently written to RocksDB, so readers of a secondary instance know what they may hold stale),
``node_store`` (the owner's side) and ``view`` (a reader's side).
"""
