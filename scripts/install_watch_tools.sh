#!/usr/bin/env bash
# Installs the Debian packages a user watches a run with, for tests/observe/test_watching.py: a Prometheus
# server that scrapes Ray's metrics export (and answers the Grafana dashboard's queries), and headless Chromium
# driven through chromedriver, which renders the run's HTML report (with a font, so its text shows in the
# screenshot). Safe to run again: returns at once when already installed.
set -euo pipefail

PACKAGES=(prometheus chromium chromium-driver fonts-dejavu-core)
BINARIES=(prometheus chromium chromedriver)

installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

missing_packages() {
  local pkg
  for pkg in "${PACKAGES[@]}"; do
    installed "$pkg" || echo "$pkg"
  done
}

missing_binaries() {
  local bin
  for bin in "${BINARIES[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || echo "$bin"
  done
}

versions() {
  echo "  $(prometheus --version 2>&1 | head -n 1)"
  echo "  $(chromium --version 2>/dev/null | head -n 1)"
  echo "  $(chromedriver --version 2>/dev/null | head -n 1)"
}

mapfile -t MISSING < <(missing_packages)
if [ "${#MISSING[@]}" -eq 0 ] && [ -z "$(missing_binaries)" ]; then
  echo "watch tools already installed:"
  versions
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install_watch_tools.sh: needs root or sudo for apt-get" >&2; exit 1; }
  SUDO=sudo
fi

# The prometheus package would start its system service (a server on :9090 left running). The tests start
# their own server on a free port, so keep services from starting during the install, the Debian way
# (policy-rc.d exit 101), unless the machine already has a policy of its own (containers usually do).
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\n# written by mazerl scripts/install_watch_tools.sh for the install only\nexit 101\n' \
    | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"
  trap '$SUDO rm -f "$POLICY"' EXIT
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
if [ "${#MISSING[@]}" -gt 0 ]; then
  $SUDO apt-get install -y -q --no-install-recommends "${MISSING[@]}"
fi

if [ -n "$(missing_binaries)" ]; then
  echo "install_watch_tools.sh: packages installed but binaries are missing: $(missing_binaries | xargs)" >&2
  exit 1
fi
echo "watch tools installed:"
versions
