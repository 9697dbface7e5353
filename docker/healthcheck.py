"""Container HEALTHCHECK: exit 0 when the server's /healthz answers 200, else 1 (no curl in the image).

The port is the one the server itself uses: HPS_SERVER__HTTP_PORT, else server.http_port in the config file
($HPS_CONFIG, default /etc/hps/config.yaml), else 8000.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

import yaml

DEFAULT_CONFIG = "/etc/hps/config.yaml"
DEFAULT_HTTP_PORT = 8000


def http_port() -> int:
    """The HTTP port the server listens on, read the way the server reads it."""
    override = os.environ.get("HPS_SERVER__HTTP_PORT")
    if override:
        return int(override)
    try:
        with open(os.environ.get("HPS_CONFIG", DEFAULT_CONFIG)) as fh:
            config = yaml.safe_load(fh) or {}
        return int((config.get("server") or {}).get("http_port", DEFAULT_HTTP_PORT))
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
        return DEFAULT_HTTP_PORT


def main() -> int:
    url = f"http://127.0.0.1:{http_port()}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HPS_HEALTHCHECK_TIMEOUT_S", "2"))) as rsp:
            return 0 if rsp.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
