#!/usr/bin/env bash
# The configs' rollout engine (CUDA graphs, engine core in its own process, keep_weights) of two source trees, one
# after the other on one GPU, each in its own process (scripts/bench/schedules.py of each tree):
#   bash scripts/bench/rollout_ab.sh OUT BEFORE_TREE [WORK] [ROUNDS]
# BEFORE_TREE: a folder holding an older app/ and scripts/ (git archive COMMIT app scripts configs | tar -x -C DIR);
# this tree runs first, then BEFORE_TREE. Results append to OUT/ab.jsonl (`tree` names each); a table last.
set -uo pipefail
OUT=${1:?out dir}; BEFORE=$(cd "${2:?before tree}" && pwd); WORK=${3:-/tmp/mazerl}; ROUNDS=${4:-2}
mkdir -p "$OUT" "$WORK"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ -f "$WORK/model_8b/config.json" ] || PYTHONPATH=. python scripts/make_model.py "$WORK/model_8b" --shape 8b > "$OUT/make_model.log" 2>&1
for tree in "$PWD" "$BEFORE"; do
  name=$([ "$tree" = "$PWD" ] && echo after || echo before)
  (cd "$tree" && PYTHONPATH=. timeout 280 python scripts/bench/schedules.py --model "$WORK/model_8b" --graphs \
    --engine-process --keep-weights --rounds "$ROUNDS" --json "$OUT/ab_$name.jsonl" > "$OUT/ab_$name.log" 2>&1) \
    || echo "$name: exit $?; $(grep -E 'Error' "$OUT/ab_$name.log" | tail -2)"
done
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'tree':7} {'start s':>8} {'rollout s':>10} {'rounds s':>16} {'GPU busy':>12} {'sync s':>7} held")
for name in ("after", "before"):
    f = out / f"ab_{name}.jsonl"
    for line in (f.read_text().splitlines() if f.exists() else []):
        r = json.loads(line)
        print(f"{name:7} {r['engine_start_s']:8.1f} {r['rollout_s']:10.2f} {str(r['rollout_rounds_s']):>16} "
              f"{str(r['gpu_busy']):>12} {r['sync_s']:7.3f} {r['held_equal']}")
PY
