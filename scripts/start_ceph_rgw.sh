#!/usr/bin/env bash
# Starts (or stops) a throwaway single-node Ceph RGW, the real S3 server the `s3` tests use, for manual
# work: the same code as the tests' `ceph_s3` fixture (tests/s3_server.py). Data lives in RAM (memstore).
#
#   eval "$(scripts/start_ceph_rgw.sh start /tmp/ceph)"    # exports AWS_ENDPOINT_URL and test keys
#   aws s3 mb s3://demo --endpoint-url "$AWS_ENDPOINT_URL"  # (or boto3, or app.storage.store.S3Store(..., endpoint_url=...))
#   scripts/start_ceph_rgw.sh stop /tmp/ceph
#
# Installs the packages first if they are missing (scripts/install_ceph_rgw.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ACTION=${1:-}
DIR=${2:-}
if [ -z "$ACTION" ] || [ -z "$DIR" ]; then
  echo "usage: $0 start|stop DIR" >&2
  exit 2
fi
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ "$ACTION" = start ]; then
  bash scripts/install_ceph_rgw.sh >&2
fi
exec "$PY" -m tests.s3_server "$ACTION" "$DIR"
