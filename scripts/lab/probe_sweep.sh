#!/usr/bin/env bash
# Perception probes side by side on one GPU: can a model/recipe variant learn to see the walls?
#   VARIANTS_SPEC="name:key=value,--flag=value name2:..." bash scripts/lab/probe_sweep.sh OUT MINUTES [CONFIG]
# Each variant runs scripts/lab/perception_probe.py with its config overrides and probe flags (comma-separated;
# PROBE_ARGS adds flags to every variant, and a variant's own flag wins over them) for at most MINUTES, in
# parallel. OUT gets probes.jsonl (every evaluation, with its variant), probe_logs.tar.gz (each variant's
# output) and a printed table of the held-out exact-answer probability (the blind prior is ~0.17; a model that
# sees scores near 1).
# Each variant keeps 1 GB of processed pictures on the GPU (8 variants at the config's 8 GB ran out of memory).
set -uo pipefail
OUT=${1:?out dir}; MINUTES=${2:?minutes}; CFG=${3:-scripts/lab/configs/learn_h200.yaml}
WORK=$(mktemp -d /tmp/probe_sweep.XXXXXX)  # this sweep's own: a warm machine may run several
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
read -r -a COMMON <<< "${PROBE_ARGS:-}"
for spec in ${VARIANTS_SPEC:?name:overrides ...}; do
  name=${spec%%:*}; extra=${spec#*:}
  # shellcheck disable=SC2086
  python scripts/lab/perception_probe.py "$CFG" "$WORK/probe_$name.jsonl" model.dtype=float32 output_dir="$WORK/runs_$name" \
    train.picture_cache_gb=1 \
    "${COMMON[@]}" ${extra//,/ } --max-minutes "$MINUTES" > "$WORK/probe_$name.log" 2>&1 &
done
wait
tar -C "$WORK" -czf "$OUT/probe_logs.tar.gz" $(cd "$WORK" && ls probe_*)
python - "$WORK" "$OUT/probes.jsonl" <<'PY'
import json, pathlib, sys
combined = pathlib.Path(sys.argv[2]).open("w")
print("\n=== perception probe: held-out p(exact open-move answer) by step; prior ~0.17 ===")
for log in sorted(pathlib.Path(sys.argv[1]).glob("probe_*.jsonl")):
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    combined.writelines(json.dumps({"variant": log.stem[6:], **r}) + "\n" for r in rows)
    if not rows:
        print(f"{log.stem[6:]:<24} (no evaluation; see {log.stem}.log)")
        continue
    best = max(rows, key=lambda r: r["p_exact"])
    curve = " ".join(f"{r['step']}:{r['p_exact']:.2f}" for r in rows[:: max(1, len(rows) // 8)])
    print(f"{log.stem[6:]:<24} best {best['p_exact']:.3f} @ {best['step']} (answered {best['answered']:.2f}); "
          f"last {rows[-1]['p_exact']:.3f} @ {rows[-1]['step']} in {rows[-1]['elapsed_s']:.0f} s | {curve}")
PY
