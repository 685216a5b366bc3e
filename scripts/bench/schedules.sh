#!/usr/bin/env bash
# Rollout engine configurations side by side on one H200, each in its own process (scripts/bench/schedules.py):
#   bash scripts/bench/schedules.sh OUT [WORK] [CONFIG...]
# CONFIG: schedules.py flags in one word with commas, e.g. "lockstep" "continuous,--graphs,--engine-process";
# default: all four of lockstep eager, lockstep graphs, continuous graphs, continuous graphs in its own process.
# LIMIT (default 290): seconds a configuration may run; the LoRA's second stream starts in ~215 s with a cold
# compile cache, so give it 400 alone in a call. The 8B-shaped model is built at WORK/model_8b if absent.
# Results append to OUT/schedules.jsonl; a table last.
set -uo pipefail
OUT=${1:?out dir}; WORK=${2:-/tmp/mazerl}; shift; shift || true
mkdir -p "$OUT" "$WORK"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=(lockstep lockstep,--graphs continuous,--graphs continuous,--graphs,--engine-process)
[ -f "$WORK/model_8b/config.json" ] || python scripts/make_model.py "$WORK/model_8b" --shape 8b > "$OUT/make_model.log" 2>&1
for c in "${CONFIGS[@]}"; do
  IFS=, read -ra flags <<< "$c"
  log="$OUT/schedules_$(tr -c 'A-Za-z0-9\n-' _ <<< "$c").log"  # the flags may hold paths
  timeout "${LIMIT:-290}" python scripts/bench/schedules.py --model "$WORK/model_8b" --schedule "${flags[@]}" --rounds "${ROUNDS:-2}" \
    --json "$OUT/schedules.jsonl" > "$log" 2>&1 || echo "$c: exit $?; $(grep -E 'Error' "$log" | tail -2)"
done
python - "$OUT/schedules.jsonl" <<'PY'
import json, sys
def gc2(r):  # the episode loop's process: full garbage collections during the rounds, and their seconds
    c = r.get("full_collections")
    return f"{c['n']}/{c['total_s']:.2f}" if c else "-"
print(f"{'schedule':11} {'process':7} {'graphs':6} {'keep':5} {'lora':6} {'start':>6} {'rollout':>8} {'rounds':>14} {'tokens':>13} {'busy':>11} {'sync':>6} {'load':>6} {'heap':6} {'gc2 n/s':>9} held (after) same (twice)")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['schedule']:11} {str(r['engine_process']):7} {str(r['graphs']):6} {str(r.get('keep_weights', False)):5} {('dual' if r.get('lora_dual_stream') else '') + ('tuned' if r.get('lora_configs') else '') + ('spec' if r.get('specialize_active_lora') else '') or '-':6} {r['engine_start_s']:6.1f} {r['rollout_s']:8.2f} "
          f"{str(r['rollout_rounds_s']):>14} {str(r['generated_tokens']):>13} {str(r['gpu_busy']):>11} {r['sync_s']:6.3f} "
          f"{r['load_awake_s']:6.3f} {'frozen' if r.get('frozen_heap') else '-':6} {gc2(r):>9} {r['held_equal']} ({r.get('held_equal_after')}) {r.get('same_after_sleeps')} ({r.get('same_twice')})")
PY
