"""The readiness reason of an update consumer, as ``/readyz`` and gRPC health give it."""

from __future__ import annotations

from hps_service.updates.consumer import UpdateConsumer


def update_consumer_not_ready(consumer: UpdateConsumer, model: str | None = None) -> str | None:
    """The readiness reason of the update consumer (for one model, or all): no partitions yet, partitions that lost
    updates (see ``watermarks``), updates failing to
    apply (nothing is stored meanwhile, so they are retried and replayed, but the served rows are going stale), a
    stalled stream (messages waiting, none applied for ``updates.stall_after_s``), or not caught up with the update
    log (at start, or after falling more than updates.max_lag_s behind)."""
    if not consumer.ready:
        reason = f"update consumer (group {consumer.group}) has no partitions yet"
        return f"{reason}: {consumer.last_error}" if consumer.last_error else reason
    if lost := consumer.lost_reason(model):
        return f"update consumer (group {consumer.group}) {lost}"
    if consumer.apply_error is not None:
        return f"update consumer (group {consumer.group}) cannot apply updates: {consumer.apply_error}"
    if consumer.stall.reason:
        return consumer.stall.reason
    behind = consumer.catching_up(model)
    return f"update consumer (group {consumer.group}) {behind}" if behind else None
