"""One node: the owner process (the single writer of the shared store), the engine and tiers its gRPC workers read
with, the workers' supervisor and the shared store itself (``node.store``)."""
