#!/usr/bin/env bash
# Regenerate the Python stubs from protos/ (run by `make proto`). They live once, in the client-only distribution
# (clients/python/hps_client/proto); hps_service.proto is an alias of that package for the server's imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=clients/python/hps_client/proto
find "$OUT" -mindepth 1 -name '*_pb2*.py*' -delete
$PY -m grpc_tools.protoc -I protos --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" $(find protos -name '*.proto' | sort)
# Generated modules import each other as `hps.v1`; make those imports package-relative.
find "$OUT" -name '*.py' -o -name '*.pyi' | xargs sed -i -E 's/^from hps\.v1 import/from hps_client.proto.hps.v1 import/'
for d in "$OUT/hps" "$OUT/hps/v1"; do [ -f "$d/__init__.py" ] || : > "$d/__init__.py"; done
