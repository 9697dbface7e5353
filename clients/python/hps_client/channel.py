"""How a client channel is built, the gRPC-native way: the service config carries the load-balancing policy
(``round_robin`` over every address a target resolves to), client-side health checking (a replica leaves the
rotation the moment its ``accepting`` health service says NOT_SERVING) and the retry policy (UNAVAILABLE,
CANCELLED and RESOURCE_EXHAUSTED are retried, on another replica when there is one, within the call's one overall
deadline); keepalive finds dead connections; callers can add or override any channel option.

Every method the policy covers is a read, so a retry is always safe. CANCELLED is retried because a Python gRPC
server cancels the calls still waiting for a handler thread when it stops (grpc/grpc#41785): under load, a replica
that drains answers some calls CANCELLED instead of UNAVAILABLE. A call the caller cancelled is never retried.
RESOURCE_EXHAUSTED is retried because an overloaded replica (its ``server.max_concurrent_requests`` reached) says
so; a request over a limit of the server (too many keys or tables) is answered with gRPC's retry pushback
``grpc-retry-pushback-ms: -1`` beside it, which tells the client not to retry.

The health service a client watches, :data:`ACCEPTING_SERVICE`, means "this replica takes calls": not starting,
bootstrapping or draining, warm, its tiers reachable. It does not follow update lag (the *ready* services and
``/readyz`` do, for probes): a broker outage that leaves every replica behind must not empty the rotation.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from hps_client.errors import InvalidArgumentError, UnavailableError

#: The services whose calls the retry policy covers.
SERVICES = ("hps.v1.EmbeddingService", "grpc.health.v1.Health")
#: The gRPC health service name a server answers SERVING under while it accepts calls (see the module docstring).
ACCEPTING_SERVICE = "hps.v1.EmbeddingService/accepting"
#: The status codes the retry policy retries.
RETRYABLE_CODES = ("UNAVAILABLE", "CANCELLED", "RESOURCE_EXHAUSTED")
#: gRPC caps a retry policy at 5 attempts.
MAX_ATTEMPTS = 5
#: Message size and retry limits without the service config: what a load generator that counts every failure uses.
BARE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
]


def service_config(retries: int = 3, backoff_s: float = 0.05, max_backoff_s: float = 1.0,
                   load_balancing: str = "round_robin", health_check: bool = True) -> str:
    """The channel's service config (JSON): ``load_balancing`` over the resolved addresses, with ``health_check``
    client-side health checking on :data:`ACCEPTING_SERVICE`, and with ``retries`` > 0 a retry policy for
    :data:`RETRYABLE_CODES` of ``retries + 1`` attempts (at most 5) with exponential backoff."""
    if retries < 0 or backoff_s < 0:
        raise InvalidArgumentError("retries and backoff_s must be >= 0")
    method: dict[str, Any] = {"name": [{"service": s} for s in SERVICES]}
    if retries > 0:
        method["retryPolicy"] = {
            "maxAttempts": min(retries + 1, MAX_ATTEMPTS),
            "initialBackoff": f"{max(backoff_s, 0.001):.3f}s",
            "maxBackoff": f"{max(max_backoff_s, backoff_s, 0.001):.3f}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": list(RETRYABLE_CODES),
        }
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}], "methodConfig": [method]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": ACCEPTING_SERVICE}
    return json.dumps(config)


def channel_options(retries: int = 3, backoff_s: float = 0.05,
                    options: Sequence[tuple[str, Any]] | None = None, *,
                    health_check: bool = True) -> list[tuple[str, Any]]:
    """The default channel options with the caller's ``options`` applied over them (same key: the caller's wins);
    ``health_check=False`` leaves client-side health checking off (servers older than hps-service 0.2 do not
    answer :data:`ACCEPTING_SERVICE`)."""
    merged: dict[str, Any] = {
        "grpc.max_receive_message_length": -1,
        "grpc.max_send_message_length": -1,
        "grpc.enable_retries": 1,
        "grpc.service_config": service_config(retries, backoff_s, health_check=health_check),
        # A retried request must be kept until the call commits: room for the largest batch (65,536 keys = 512 KiB).
        "grpc.per_rpc_retry_buffer_size": 8 << 20,
        # Keepalive: a ping every 30 s (the server permits one every 10 s), the connection dropped when no answer
        # comes within 10 s, so a replica that vanished without closing its sockets is left, not waited on.
        "grpc.keepalive_time_ms": 30_000,
        "grpc.keepalive_timeout_ms": 10_000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
        # Re-resolve a dns:/// name soon after a replica goes away (new pods, new addresses), and reconnect to a
        # restarted replica within seconds (gRPC's default backoff grows to 120 s).
        "grpc.dns_min_time_between_resolutions_ms": 2_000,
        "grpc.max_reconnect_backoff_ms": 5_000,
        # Reconnect 50 ms (not gRPC's default 1 s) after a refused or reset connection attempt: when one of a
        # node's worker processes dies, connections the kernel hands its listener in the tens of milliseconds
        # before the listener closes are reset (SO_REUSEPORT), and a 1 s back-off would outlast every retry.
        "grpc.initial_reconnect_backoff_ms": 50,
    }
    for key, value in options or ():
        merged[key] = value
    return list(merged.items())


Metadata = Sequence[tuple[str, str | bytes]]


def merge_metadata(client: Metadata | None, call: Metadata | None) -> tuple[tuple[str, str | bytes], ...] | None:
    """The metadata of one call: the client's (sent on every call) followed by the call's own; None when neither
    gives any. Keys must be lower case (gRPC's rule); InvalidArgumentError names one that is not."""
    if not client and not call:
        return None
    merged = (*(client or ()), *(call or ()))
    for key, _ in merged:
        if not isinstance(key, str) or key != key.lower() or not key:
            raise InvalidArgumentError(f"metadata key {key!r} must be a non-empty lower-case string")
    return tuple(merged)


def _split_host_port(target: str) -> tuple[str, str]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgumentError(f"replica target {target!r} is not host:port")
    return host.strip("[]"), port


def channel_target(targets: str | Iterable[str]) -> str:
    """One gRPC target for ``targets``.

    A string is used as it is (``host:port``, ``dns:///name:port``, ``ipv4:a:p,b:p``, ``unix:path``...). A list of
    several ``host:port`` replicas becomes one ``ipv4:``/``ipv6:`` target over all of their addresses, resolved
    now; for a set of replicas that changes (pods), give one ``dns:///`` name instead, which gRPC re-resolves.
    """
    if isinstance(targets, str):
        if not targets:
            raise InvalidArgumentError("the client needs a target host:port")
        return targets
    items = list(targets)
    if not items:
        raise InvalidArgumentError("the client needs at least one target host:port")
    if len(items) == 1:
        return items[0]
    v4: list[str] = []
    v6: list[str] = []
    families: list[set[int]] = []
    for item in items:
        host, port = _split_host_port(item)
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise UnavailableError(f"replica {item}: cannot resolve {host}: {exc.strerror}") from None
        seen: set[int] = set()
        for family, _, _, _, sockaddr in infos:
            ip = ipaddress.ip_address(sockaddr[0])
            if family == socket.AF_INET and f"{ip}:{port}" not in v4:
                v4.append(f"{ip}:{port}")
            elif family == socket.AF_INET6 and f"[{ip}]:{port}" not in v6:
                v6.append(f"[{ip}]:{port}")
            seen.add(family)
        families.append(seen)
    if all(socket.AF_INET in f for f in families):
        return "ipv4:" + ",".join(v4)
    if all(socket.AF_INET6 in f for f in families):
        return "ipv6:" + ",".join(v6)
    raise InvalidArgumentError(f"replicas {items} mix IPv4-only and IPv6-only addresses; give one dns:/// name")
