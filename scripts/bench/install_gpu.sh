#!/usr/bin/env bash
# On the H200 machine: checks, reassembles and installs the vLLM + Ray wheel bundle that
# ../shared/gpu/pack.sh built and earlier device calls copied piece by piece into W (default /tmp/w).
#   bash scripts/bench/install_gpu.sh [W]      (expects .gpu-wheels/SHA256SUMS carried with this call)
# Wheels in .gpu-wheels/extra (scripts/bench/pack_extra.sh: boto3, py-spy), when carried too, install first.
set -euo pipefail
W=${1:-/tmp/w}
missing=()
for whl in .gpu-wheels/extra/*.whl; do  # only what the image lacks: its own versions of the others stay
  [ -f "$whl" ] || continue
  python3 -m pip show -q "$(basename "$whl" | cut -d- -f1)" > /dev/null 2>&1 || missing+=("$whl")
done
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile "${missing[@]}" && echo "installed ${missing[*]}"
fi
python3 -c "import vllm, ray" 2>/dev/null && { echo "vllm and ray already installed"; exit 0; }
cp .gpu-wheels/SHA256SUMS "$W/"
(cd "$W" && sha256sum -c --quiet SHA256SUMS)
start=$(date +%s)
(cd "$W" && cat p[0-9]* | python3 -c "import tarfile,sys;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('w',filter='data')")
python3 -m pip install -q --no-index --no-deps --no-compile "$W"/w/*.whl
python3 -c "import vllm, ray; print('installed vllm', vllm.__version__, 'ray', ray.__version__, 'in', $(date +%s) - $start, 's')"
