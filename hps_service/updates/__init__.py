"""Online updates: the Kafka update message, the trainer's Publisher and the server's UpdateConsumer."""

from hps_service.updates.consumer import UpdateConsumer
from hps_service.updates.message import make_version, split_version, topic_name
from hps_service.updates.publisher import Publisher

__all__ = ["Publisher", "UpdateConsumer", "make_version", "split_version", "topic_name"]
