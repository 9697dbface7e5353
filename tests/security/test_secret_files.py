"""Secrets from files (every ``*_file`` key), the checks of ``server.auth`` and the readers, and a watched secret
following its file: errors name the key and the path, never the value."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hps_service.config import ConfigError, load_config
from hps_service.config.secrets import WatchedSecret

VALUE = "a-secret-value-that-must-not-leak"


@pytest.mark.parametrize("section,key", [
    ("server", "admin_token"), ("volatile", "password"), ("updates", "sasl_password"), ("updates", "admin_key"),
    ("persistent", "s3_access_key_id"), ("persistent", "s3_secret_access_key"),
])
def test_every_secret_can_come_from_a_file(tmp_path: Path, section: str, key: str) -> None:
    secret = tmp_path / key
    secret.write_text(VALUE + "\n")  # as an editor or `echo` leaves it
    extra = {"s3_access_key_id": {"s3_secret_access_key": "x"}, "s3_secret_access_key": {"s3_access_key_id": "x"},
             "password": {"type": "redis_cluster", "nodes": ["redis:6379"]}}
    cfg = load_config(None, **{section: {f"{key}_file": str(secret), **extra.get(key, {})}})
    assert getattr(getattr(cfg, section), key).get_secret_value() == VALUE
    if key == "sasl_password":
        assert cfg.updates.kafka_config["sasl.password"] == VALUE
    with pytest.raises(ConfigError, match=f"set {section}.{key} or {section}.{key}_file, not both"):
        load_config(None, **{section: {f"{key}_file": str(secret), key: "other", **extra.get(key, {})}})


@pytest.mark.parametrize("content,complaint", [(None, "cannot be read"), ("", "is empty"), ("\n", "is empty"),
                                               (b"\xff\xfe", "is not UTF-8")])
def test_an_unusable_secret_file_is_named_not_shown(tmp_path: Path, content, complaint: str) -> None:
    path = tmp_path / "token"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as refused:
        load_config(None, server={"admin_token_file": str(path)})
    assert "server.admin_token_file" in str(refused.value) and str(path) in str(refused.value)
    assert complaint in str(refused.value)


@pytest.mark.parametrize("server,complaint", [
    ({"auth": "token"}, "needs at least one entry in server.readers"),
    ({"auth": "token", "readers": [{"name": "a", "models": ["m"]}]}, r"reader\(s\) a have no token"),
    ({"auth": "token", "readers": [{"name": "a", "token": "short", "models": ["m"]}]}, "at least 16 characters"),
    ({"auth": "token", "readers": [{"name": "a", "token": VALUE, "models": ["m"]},
                                   {"name": "b", "token": VALUE, "models": ["m"]}]}, "share a token"),
    ({"auth": "token", "readers": [{"name": "admin", "token": VALUE, "models": ["m"]}]}, "the admin token's"),
    ({"readers": [{"name": "a", "token": VALUE, "models": ["m"]}]}, "server.auth is none"),
    ({"auth": "mtls", "readers": [{"name": "a", "identity": "a", "models": ["m"]}]}, "needs server.tls"),
    ({"auth": "token", "readers": [{"name": "a", "token": VALUE, "models": []}]}, "at least 1 item"),
])
def test_auth_settings_that_would_lock_out_or_let_in_are_refused(server: dict, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint) as refused:
        load_config(None, server=server)
    assert VALUE not in str(refused.value)


def test_a_watched_secret_follows_its_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first-token-value-0001")
    watched = WatchedSecret(path, "server.admin_token_file", check_every_s=0.0)
    assert watched.get() == "first-token-value-0001" and watched.generation == 0
    (tmp_path / "new").write_text("second-token-value-02\n")
    os.replace(tmp_path / "new", path)
    assert watched.get() == "second-token-value-02" and watched.generation == 1
    path.write_text("")  # emptied: no secret (fail closed), and why is kept
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert watched.get() is None and "is empty" in (watched.error or "") and watched.generation == 2
    path.unlink()  # gone: no secret either
    assert watched.get() is None and "cannot be read" in (watched.error or "")
    (tmp_path / "new").write_text("third-token-value-0003")
    os.replace(tmp_path / "new", path)
    assert watched.get() == "third-token-value-0003" and watched.error is None and watched.generation == 3
