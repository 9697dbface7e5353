"""The node's shared store: L1's and the hash-map tier's arrays, the counters and the queues, as files of one
memory-backed directory that every process of the node maps (the primitives are in :mod:`hps_service.shm`).

One process (the owner) creates and writes it; the gRPC worker processes and colocated readers
(:class:`hps_service.local.LocalClient`) attach to it and read it without locks (sequence locks, see
``tiers/hashmap/seqlock.read_rows_at`` and ``cache/cpu_kernels.query_kernel``). Modules: ``layout`` (the header, a
generation's directory and its manifest), ``l3_events`` (the owner's announcements to the workers' RocksDB
secondaries), ``node_store`` (the owner's side) and ``view`` (a reader's side).
"""
