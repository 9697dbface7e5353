"""How hps-client builds its channel: the service config (round_robin, health checking on the accepting service, the
retry policy), the options a caller adds or overrides, and the one target a list of replicas becomes."""

from __future__ import annotations

import json

import pytest

from hps_client import ACCEPTING_SERVICE, InvalidArgumentError, channel_options, channel_target, service_config


def test_service_config_balances_health_checks_and_retries() -> None:
    config = json.loads(service_config(retries=3, backoff_s=0.05))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ACCEPTING_SERVICE}
    assert "healthCheckConfig" not in json.loads(service_config(health_check=False))
    (method,) = config["methodConfig"]
    assert {"service": "hps.v1.EmbeddingService"} in method["name"]
    policy = method["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED", "RESOURCE_EXHAUSTED"]
    assert policy["maxAttempts"] == 4
    assert policy["initialBackoff"] == "0.050s"
    assert json.loads(service_config(retries=9))["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 5  # gRPC's cap
    assert "retryPolicy" not in json.loads(service_config(retries=0))["methodConfig"][0]
    with pytest.raises(InvalidArgumentError):
        service_config(retries=-1)


def test_caller_options_override_the_defaults() -> None:
    defaults = dict(channel_options())
    assert defaults["grpc.enable_retries"] == 1 and defaults["grpc.keepalive_time_ms"] == 30_000
    pick_first = json.dumps({"loadBalancingConfig": [{"pick_first": {}}]})
    merged = dict(channel_options(options=[("grpc.keepalive_time_ms", 5_000), ("grpc.service_config", pick_first),
                                           ("grpc.primary_user_agent", "ranker/1.2")]))
    assert merged["grpc.keepalive_time_ms"] == 5_000 and merged["grpc.service_config"] == pick_first
    assert merged["grpc.primary_user_agent"] == "ranker/1.2" and merged["grpc.enable_retries"] == 1


def test_targets() -> None:
    assert channel_target("dns:///hps-headless.ml.svc:8500") == "dns:///hps-headless.ml.svc:8500"
    assert channel_target(["10.0.0.1:8500"]) == "10.0.0.1:8500"
    assert channel_target(["127.0.0.1:1", "127.0.0.2:2", "127.0.0.1:1"]) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert channel_target(["[::1]:5", "[::1]:6"]) == "ipv6:[::1]:5,[::1]:6"
    for bad in ([], "", ["no-port", "127.0.0.1:1"]):
        with pytest.raises(InvalidArgumentError):
            channel_target(bad)
