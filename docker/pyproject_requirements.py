"""Print the project's runtime requirements (plus the named extras) from pyproject.toml, one per line.

The image build installs these in a layer of their own, so changing the code does not reinstall them.
Usage: python pyproject_requirements.py pyproject.toml [EXTRA,...]
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject_path: str, extras: list[str]) -> list[str]:
    """The ``[project] dependencies`` and each named optional-dependency group."""
    with open(pyproject_path, "rb") as fh:
        project = tomllib.load(fh)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(optional)}")
    return list(project.get("dependencies", [])) + [dep for extra in extras for dep in optional[extra]]


if __name__ == "__main__":
    names = [e for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if e]
    print("\n".join(requirements(sys.argv[1], names)))
