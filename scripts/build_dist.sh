#!/usr/bin/env bash
# Build the wheels and sdists of both distributions (hps-client from clients/python, hps-service from the root)
# into ${DIST:-dist} and check their metadata with twine (run by `make dist` and tests/test_packaging.py, which sets
# FORMATS=--wheel: the wheels hold everything installed, and each sdist costs another build). No build isolation:
# the build backend (setuptools, wheel) comes from the virtualenv, so it builds offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIST=${DIST:-dist}
read -r -a FORMATS <<< "${FORMATS:---sdist --wheel}"
rm -rf "$DIST"
for project in clients/python .; do
  "$PY" -m build --no-isolation "${FORMATS[@]}" --outdir "$DIST" "$project" >/dev/null
done
rm -rf build/lib build/bdist.* clients/python/build
"$PY" -m twine check --strict "$DIST"/*
