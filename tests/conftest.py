"""Shared pytest fixtures: real servers started for the session and stopped after."""
from tests.fixtures.kafka_broker import kafka_broker  # noqa: F401
from tests.fixtures.redis_cluster import redis_cluster, redis_cluster_clean  # noqa: F401
