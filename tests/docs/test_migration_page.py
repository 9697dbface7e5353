"""The HugeCTR migration page (docs/migrating-from-hugectr.md) names every ps.json key the converter knows
(hps_service.config.hugectr_keys), so the page and ``hps config from-hugectr`` cannot drift apart silently."""

from __future__ import annotations

from hps_service.config import hugectr_keys as keys
from tests.helpers import REPO


def test_the_migration_page_names_every_hps_key_the_converter_knows() -> None:
    page = (REPO / "docs" / "migrating-from-hugectr.md").read_text()
    known = (set(keys.NOT_APPLICABLE_TOP) | set(keys.NOT_APPLICABLE_MODEL) | keys.MODEL_KEYS | keys.CACHE_KEYS
             | keys.VOLATILE_KEYS | set(keys.NOT_APPLICABLE_VOLATILE) | set(keys.NOT_APPLICABLE_PERSISTENT)
             | set(keys.NOT_APPLICABLE_UPDATES) | {"brokers", "metadata_refresh_interval_ms", "path", "read_only"})
    wildcard = {k for k in known if k.startswith(("shared_memory_", "tls_client_"))}
    missing = sorted(k for k in known - wildcard if f"`{k}`" not in page and f"`{k}:" not in page)
    assert not missing, f"keys the converter maps that docs/migrating-from-hugectr.md does not name: {missing}"
    assert "`shared_memory_*`" in page and "`tls_client_*`" in page
