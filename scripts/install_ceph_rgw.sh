#!/usr/bin/env bash
# Installs the Debian packages of a single-node Ceph cluster with the RADOS gateway: the one real
# S3 server Debian ships (no MinIO/Garage/SeaweedFS there). The `s3`-marked
# tests start it through tests/s3_server.py. Safe to run again: returns at once when already installed.
set -euo pipefail

PACKAGES=(radosgw ceph-mon ceph-osd)
BINARIES=(radosgw radosgw-admin ceph-mon ceph-osd ceph-authtool monmaptool ceph)

all_present() {
  local bin
  for bin in "${BINARIES[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || return 1
  done
}

if all_present; then
  echo "ceph rgw already installed: $(ceph-mon --version 2>/dev/null | head -n 1)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install_ceph_rgw.sh: needs root or sudo for apt-get" >&2; exit 1; }
  SUDO=sudo
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"

if ! all_present; then
  echo "install_ceph_rgw.sh: packages installed but some binaries are missing: ${BINARIES[*]}" >&2
  exit 1
fi
echo "ceph rgw installed: $(ceph-mon --version | head -n 1)"
