"""HugeCTR HPS's ps.json keys as :mod:`hps_service.config.hugectr` maps them: those with no counterpart here and
why, the ones it maps by section, and HPS's defaults it needs."""

from __future__ import annotations

#: Our sections, in the order the YAML writes them.
SECTIONS = ("server", "cache", "volatile", "persistent", "updates", "models")
#: HPS's table names when ``embedding_table_names`` is left out.
DEFAULT_TABLE_NAME = "sparse_embedding{}"
#: HPS's overflow_margin when unset: no bound.
UNBOUNDED = 2**64 - 1
#: HPS's num_partitions of a hash map when unset: min(CPU cores of its build machine, 16).
HPS_HASH_MAP_PARTITIONS = 16
#: Our server.max_batch_keys default (a request's keys).
MAX_BATCH_KEYS = 65536

DENSE = "the dense part of the model, which HPS's inference engine ran; hps-service serves embeddings only (the " \
        "dense tower runs in your inference service, e.g. hps_service.trainer.Predictor for hps train's towers)"
POOLS = "a memory pool of HPS's GPU embedding cache; the L1 cache here needs none (each request brings its buffers)"
NOT_APPLICABLE_MODEL: dict[str, str] = {
    "dense_file": DENSE, "network_file": DENSE, "label_dim": DENSE, "slot_num": DENSE,
    "maxnum_des_feature_per_sample": DENSE, "use_mixed_precision": DENSE, "mixed_precision": DENSE, "scaler": DENSE,
    "use_algorithm_search": DENSE, "use_cuda_graph": DENSE,
    "num_of_worker_buffer_in_pool": POOLS, "num_of_refresher_buffer_in_pool": POOLS, "thread_pool_size": POOLS,
    "use_context_stream": "a CUDA stream of the TensorFlow/TensorRT plugins; lookups here are gRPC calls (or "
                          "LocalClient reads of the node's shared memory)",
    "i64_input_key": "keys are int64 always (a client widens int32 keys)",
    "refresh_delay": "the refresh here starts with the server; its period is cache.refresh_interval_s",
}
NOT_APPLICABLE_TOP: dict[str, str] = {
    "supportlonglong": "keys are int64 always (a client widens int32 keys)",
    "fuse_embedding_table": "each table keeps its own storage; several tables are looked up in one call with "
                            "client.lookup_many",
}
NOT_APPLICABLE_VOLATILE: dict[str, str] = {
    "allocation_rate": "the hash map reserves address space and uses memory as rows arrive",
    "max_batch_size": "no chunking to configure: a lookup's misses go to the volatile tier in one call",
    "max_get_batch_size": "no chunking to configure: a lookup's misses go to the volatile tier in one call",
    "max_set_batch_size": "no chunking to configure: an update batch is written in one call",
    "refresh_time_after_fetch": "rows carry versions here: an update replaces a row, nothing expires by fetch time",
    "algorithm": "one hash map implementation here",
    "shared_memory_size": "a node's worker processes share the hash map through /dev/shm already (server.workers)",
    "shared_memory_name": "a node's worker processes share the hash map through /dev/shm already (server.workers)",
    "shared_memory_auto_remove": "the node's shared store is removed when its owner stops",
    "initial_cache_rate": "the hash map tier is filled from RocksDB at each start when a table fits "
                          "volatile.capacity_rows; a Redis Cluster is filled as rows are read",
    "cache_missed_embeddings": "always on here: a row found in RocksDB is promoted into the tiers above",
    "update_filters": "each model of the config follows its own update topic; no other model's updates are read",
    "tls_client_certificate": "the Redis tier verifies the nodes (volatile.ca_file) and authenticates with "
                              "AUTH, not a client certificate",
    "tls_client_key": "the Redis tier verifies the nodes (volatile.ca_file) and authenticates with AUTH",
    "tls_server_name_identification": "the nodes' certificates are checked against the names in volatile.nodes",
}
NOT_APPLICABLE_PERSISTENT: dict[str, str] = {
    "num_threads": "RocksDB reads run on the gRPC worker processes; its background threads are its own",
    "max_batch_size": "no chunking to configure: a lookup's misses are one RocksDB multi-get",
    "max_get_batch_size": "no chunking to configure: a lookup's misses are one RocksDB multi-get",
    "max_set_batch_size": "no chunking to configure: an update batch is one RocksDB write batch",
    "update_filters": "each model of the config follows its own update topic; no other model's updates are read",
}
NOT_APPLICABLE_UPDATES: dict[str, str] = {
    "receive_buffer_size": "librdkafka's fetch sizes fit hps-service's update messages; set others in "
                           "updates.kafka_config",
    "poll_timeout_ms": "messages are applied as they arrive, a batch per poll",
    "max_batch_size": "messages are applied as they arrive, a batch per poll",
    "failure_backoff_ms": "a batch that cannot be applied stops the partition and is retried; see updates.md",
    "max_commit_interval": "offsets are committed once the rows they carry are durable in RocksDB",
}
#: A model's keys this converter maps (besides those of NOT_APPLICABLE_MODEL).
MODEL_KEYS = {"model", "sparse_files", "embedding_vecsize_per_table", "embedding_table_names",
              "default_value_for_each_table", "max_batch_size", "maxnum_catfeature_query_per_table_per_sample"}
#: A model's keys of the L1 cache: per model in HPS, one cache section here.
CACHE_KEYS = {"gpucache", "gpucacheper", "hit_rate_threshold", "refresh_interval",
              "cache_refresh_percentage_per_iteration", "deployed_device_list", "device_id", "use_static_table",
              "embedding_cache_type"}
VOLATILE_KEYS = {"type", "address", "user_name", "password", "num_partitions", "overflow_margin", "overflow_policy",
                 "overflow_resolution_target", "enable_tls", "tls_ca_certificate", "initialize_after_startup"}
OVERFLOW_POLICY = {"evict_oldest": "lru", "evict_least_used": "lfu", "evict_random": "lru"}
REDIS_POLICY = {"evict_oldest": "allkeys-lru", "evict_least_used": "allkeys-lfu", "evict_random": "allkeys-random"}
