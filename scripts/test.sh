#!/usr/bin/env bash
# Runs the test suite in .venv (made by scripts/setup.sh). Extra arguments go to pytest.
# Tests that need a GPU are marked `gpu` and skip themselves on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
