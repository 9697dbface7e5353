#!/usr/bin/env bash
# A stand-in for the CPU image's FROM base (python:3.11-slim-bookworm), since no container registry can be reached
# here: a Debian bookworm rootfs from mmdebstrap (minbase with python3, python3-venv, python-is-python3 and
# ca-certificates; the host's CA bundle trusted, so pip works inside the build), imported with podman under the name
# the Dockerfile expects. Skipped when that image exists already. Usage: docker/build_base.sh [IMAGE_NAME]
set -euo pipefail
NAME=${1:-docker.io/library/python:3.11-slim-bookworm}
if podman image exists "$NAME"; then
  echo "base image $NAME exists"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
  --customize-hook='copy-in /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/' bookworm "$tmp/base.tar"
podman import --change 'CMD ["python3"]' "$tmp/base.tar" "$NAME"
