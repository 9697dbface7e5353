"""The hps-service process: composition from config (``build``), start, drain and signals (``process``),
readiness (``readiness``), and a node's gRPC worker process (``worker``, ``fork_preload``)."""
