"""The Redis Cluster volatile tier: :class:`RedisClusterTier` (``volatile.type: redis_cluster``).

``tier`` holds the tier operations, ``topology`` the nodes (slot routing, pipelining, back-off), ``scripts`` the Lua
scripts and ``resp`` the wire framing.
"""

from hps_service.tiers.redis.tier import RedisClusterTier

__all__ = ["RedisClusterTier"]
