"""hps-service: a hierarchical parameter server for recommendation and MoE embeddings."""

__version__ = "0.1.0"
