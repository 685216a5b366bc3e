#!/usr/bin/env bash
# Installs the real services the test suite starts, from Debian's packages: Ceph RGW (the S3 server) and what a
# user watches a run with (Prometheus, headless Chromium). Safe to run again: each part returns at once when done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_ceph_rgw.sh
bash scripts/install_watch_tools.sh
