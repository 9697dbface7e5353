"""Shared-memory primitives that tiers and the node build on: named array regions (``region``), per-thread counters
(``counters``), single-producer rings (``queue``), change logs (``changes``), who may map them (``permissions``)."""
