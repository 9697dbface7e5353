"""Print the project's runtime requirements (plus the named extras) from pyproject.toml, one per line.

The image build installs these in a layer of their own, so changing the code does not reinstall them. The
client-only distribution ``hps-client`` is left out: it is not on an index, the build installs it from
clients/python.
Usage: python pyproject_requirements.py pyproject.toml [EXTRA,...]
"""

from __future__ import annotations

import re
import sys
import tomllib

#: Requirements built from this repository rather than fetched from an index.
LOCAL = {"hps-client"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(pyproject_path: str, extras: list[str]) -> list[str]:
    """The ``[project] dependencies`` and each named optional-dependency group."""
    with open(pyproject_path, "rb") as fh:
        project = tomllib.load(fh)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(optional)}")
    wanted = list(project.get("dependencies", [])) + [dep for extra in extras for dep in optional[extra]]
    return [dep for dep in wanted if _name(dep) not in LOCAL]


if __name__ == "__main__":
    names = [e for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if e]
    print("\n".join(requirements(sys.argv[1], names)))
