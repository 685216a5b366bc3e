#!/usr/bin/env bash
# Downloads, here, the wheels that the device's image lacks beside the vLLM + Ray bundle: boto3 and its own needs
# (the driver imports app.storage, which holds the S3 store) and py-spy (profiles), at requirements/cpu.lock's
# versions, into .gpu-wheels/extra (git-ignored, ~20 MB). Carry the folder with the call that runs install_gpu.sh.
#   bash scripts/bench/pack_extra.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.gpu-wheels/extra
grep -qx "/.gpu-wheels/" .git/info/exclude 2>/dev/null || echo "/.gpu-wheels/" >> .git/info/exclude
rm -rf "$DEST"; mkdir -p "$DEST"
pins=$(grep -E "^(boto3|botocore|s3transfer|jmespath|python-dateutil|six|urllib3)==" requirements/cpu.lock)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$DEST" $pins py-spy==0.4.1
ls "$DEST"
