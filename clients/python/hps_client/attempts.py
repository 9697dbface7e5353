"""More than one attempt at a call: hedging (a second copy of a slow call sent to another replica, the first answer
taken) and which failures are worth another replica.

The policy is gRPC's own ``hedgingPolicy`` of the service config (gRFC A6: ``maxAttempts``, ``hedgingDelay``,
``nonFatalStatusCodes``). gRPC's C core, which grpcio wraps, parses that policy but does not hedge (it sends one
attempt), so the client runs it itself: the first attempt goes out at once, another every ``hedgingDelay`` while
none has answered (up to ``maxAttempts`` in all), one at once after a non-fatal failure; the first answer wins and
the others are cancelled. With the channel's ``round_robin`` each attempt goes to the next replica. Every hedged
method is a read, so a duplicate is always safe; it costs the fleet up to ``maxAttempts`` times the work of the
calls that are slow, so keep ``hedgingDelay`` near the p95 latency.
"""

from __future__ import annotations

import asyncio
import queue
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from hps_client.errors import InvalidArgumentError

#: gRPC caps the attempts of a hedging (and retry) policy at 5.
MAX_HEDGED_ATTEMPTS = 5
#: The trailing metadata with which a server says "do not retry this" (gRFC A6 server pushback, a negative value).
PUSHBACK = "grpc-retry-pushback-ms"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")


@dataclass(frozen=True, slots=True)
class HedgingPolicy:
    """Up to ``max_attempts`` copies of a call, one more every ``delay_s`` while none answered; a failure with a
    code in ``non_fatal_codes`` sends the next copy at once, any other ends the call."""

    max_attempts: int = 2
    delay_s: float = 0.05
    non_fatal_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= MAX_HEDGED_ATTEMPTS:
            raise InvalidArgumentError(f"hedging maxAttempts must be in [2, {MAX_HEDGED_ATTEMPTS}], "
                                       f"got {self.max_attempts}")
        if self.delay_s < 0:
            raise InvalidArgumentError(f"hedging delay must be >= 0 s, got {self.delay_s}")

    @classmethod
    def parse(cls, policy: HedgingPolicy | Mapping[str, Any]) -> HedgingPolicy:
        """A policy as it is, or from gRPC's service-config form, e.g. ``{"maxAttempts": 3, "hedgingDelay":
        "0.02s", "nonFatalStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}``."""
        if isinstance(policy, HedgingPolicy):
            return policy
        unknown = set(policy) - {"maxAttempts", "hedgingDelay", "nonFatalStatusCodes"}
        if unknown:
            raise InvalidArgumentError(f"unknown hedgingPolicy field(s): {', '.join(sorted(unknown))}")
        delay = str(policy.get("hedgingDelay", "0s"))
        match = _DURATION.match(delay)
        if match is None:
            raise InvalidArgumentError(f"hedgingDelay {delay!r} is not a duration in seconds such as '0.02s'")
        codes = []
        for name in policy.get("nonFatalStatusCodes", ()):
            try:
                codes.append(grpc.StatusCode[str(name).upper()])
            except KeyError:
                raise InvalidArgumentError(f"nonFatalStatusCodes: {name!r} is not a gRPC status code") from None
        try:
            attempts = int(policy.get("maxAttempts", 2))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"maxAttempts {policy.get('maxAttempts')!r} is not an integer") from None
        return cls(max_attempts=attempts, delay_s=float(match.group(1)), non_fatal_codes=frozenset(codes))


def retry_elsewhere(err: grpc.RpcError) -> bool:
    """Whether a failed call is worth another replica: UNAVAILABLE, or RESOURCE_EXHAUSTED without the server's
    pushback saying the request itself is over a limit (another replica would refuse it too)."""
    code = err.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing: Sequence[tuple[str, Any]] = (
        err.trailing_metadata() or () if hasattr(err, "trailing_metadata") else ())  # type: ignore[assignment]  # grpc-stubs say _Metadatum; at run time (key, value) tuples
    return not any(key == PUSHBACK and str(value).startswith("-") for key, value in trailing)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def call_hedged(start: Callable[[], grpc.Future], policy: HedgingPolicy, deadline: float | None) -> Any:
    """The first answer of up to ``policy.max_attempts`` attempts made by ``start`` (each a gRPC call future);
    raises the fatal failure, or the last non-fatal one when every attempt failed."""
    finished: queue.SimpleQueue[grpc.Future] = queue.SimpleQueue()
    calls: list[grpc.Future] = []

    def launch() -> None:
        call = start()
        calls.append(call)
        call.add_done_callback(finished.put)

    launch()
    pending = 1
    try:
        while True:
            left = _left(deadline)
            more = len(calls) < policy.max_attempts and (left is None or left > 0)
            wait = (policy.delay_s if left is None else min(policy.delay_s, left)) if more else None
            try:
                call = finished.get(timeout=wait)
            except queue.Empty:
                launch()
                pending += 1
                continue
            pending -= 1
            error = call.exception()
            if error is None:
                return call.result()
            if not isinstance(error, grpc.RpcError) or error.code() not in policy.non_fatal_codes:
                raise error
            if len(calls) < policy.max_attempts:
                launch()
                pending += 1
            elif pending == 0:
                raise error
    finally:
        for call in calls:
            call.cancel()  # a no-op for the finished ones


async def call_hedged_async(start: Callable[[], Awaitable[Any]], policy: HedgingPolicy,
                            deadline: float | None) -> Any:
    """:func:`call_hedged` for grpc.aio calls (``start`` returns an awaitable call)."""
    tasks: list[asyncio.Future] = []

    def launch() -> None:
        tasks.append(asyncio.ensure_future(start()))

    launch()
    try:
        while True:
            left = _left(deadline)
            more = len(tasks) < policy.max_attempts and (left is None or left > 0)
            wait = (policy.delay_s if left is None else min(policy.delay_s, left)) if more else None
            done, _ = await asyncio.wait([t for t in tasks if not t.done()], timeout=wait,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                launch()
                continue
            for task in done:
                error = task.exception()
                if error is None:
                    return task.result()
                if not isinstance(error, grpc.aio.AioRpcError) or error.code() not in policy.non_fatal_codes:
                    raise error
                if len(tasks) < policy.max_attempts:
                    launch()
                elif all(t.done() for t in tasks):
                    raise error
    finally:
        for task in tasks:
            task.cancel()
