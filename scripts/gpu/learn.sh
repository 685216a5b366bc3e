#!/usr/bin/env bash
# The learning run on one H200 (docs/RESULTS.md), in stages that each fit one 10-minute device call.
#   bash scripts/gpu/learn.sh see  OUT WORK MINUTES
#       first teach the model of configs/learn_h200.yaml (random weights) to see walls: scripts/perception_probe.py
#       on open-move questions alone, alone on the GPU, until the held-out exact-answer probability passes
#       SEE_ABOVE (0.95) or time runs out; saves WORK/seeing, which the sft stage starts from (INIT=WORK/seeing).
#   bash scripts/gpu/learn.sh see+sft OUT WORK MINUTES
#       both in one call: see for at most SEE_MINUTES (default all of MINUTES), then sft from WORK/seeing for the rest.
#   bash scripts/gpu/learn.sh sft  OUT WORK MINUTES
#       full-model SFT of the small Qwen3-VL in configs/learn_h200.yaml from random weights (or from INIT),
#       variants side by side on the one GPU (SIZES="7 9" mazes x SFT_LRS="1e-3 3e-4", x VARIANTS_SPEC), each saving and
#       evaluating a checkpoint every 25 steps (STOP_ABOVE=0.5: stop a variant once it passes 50%). Picks the start of GRPO: the checkpoint with the highest held-out solve
#       rate that is still <= 50%; writes WORK/choice.env and packs it into OUT/start.tar.* (to carry on).
#   bash scripts/gpu/learn.sh grpo OUT WORK MINUTES
#       GRPO (app.main, vLLM rollouts, LoRA r32) from the chosen checkpoint, resuming from its latest
#       checkpoint when WORK holds one; beside it on the same GPU the control: the same checkpoint's SFT
#       continued for the same wall time (continuing the previous control when there is one).
# Smoke test on a CPU: DEVICE=cpu EVAL_EVERY=1 EXTRA="eval.num_mazes=2 sft.mazes_per_step=2 ..." (the grpo stage
# then needs EXTRA to hold placement.gpus_per_bundle=0 model.dtype=float32 too).
# Logs and metrics land in OUT (at most 8 files come back from a device call); a table is printed last.
set -uo pipefail
STAGE=${1:?sft|grpo}; OUT=${2:?out dir}; WORK=${3:?work dir}; MINUTES=${4:?minutes}
mkdir -p "$OUT" "$WORK"
export RAY_AUTH_MODE=disabled VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=3
CFG=configs/learn_h200.yaml
SIZE7=(maze.size=7 rollout.max_turns=25 train.dataset_size=704)
SIZE9=(maze.size=9 rollout.max_turns=25 train.dataset_size=20000)
# EXTRA: more key=value overrides for every run; DEVICE and EVAL_EVERY: for a smoke test on a CPU
read -r -a EXTRA <<< "${EXTRA:-}"
SFT_ARGS=(model.dtype=float32 rollout.engine=hf output_dir="$WORK/runs" "${EXTRA[@]}" --full --device "${DEVICE:-cuda}"
          --eval-every "${EVAL_EVERY:-25}")

if [ "$STAGE" = see ] || [ "$STAGE" = see+sft ]; then
  t0=$(date +%s)
  python scripts/perception_probe.py "$CFG" "$OUT/see.jsonl" model.dtype=float32 output_dir="$WORK/runs" "${EXTRA[@]}" \
    --device "${DEVICE:-cuda}" --batch "${SEE_BATCH:-128}" --lr "${SEE_LR:-3e-4}" --eval-every "${SEE_EVAL_EVERY:-50}" \
    --steps 1000000 --max-minutes "${SEE_MINUTES:-$MINUTES}" --stop-above "${SEE_ABOVE:-0.95}" --save "$WORK/seeing" \
    2>&1 | grep -v "it/s]"
  rc=${PIPESTATUS[0]}
  [ "$STAGE" = see ] && exit "$rc"
  [ "$rc" = 0 ] && [ -d "$WORK/seeing" ] || { echo "the see stage failed (exit $rc): no $WORK/seeing"; exit 2; }
  # see+sft: the warm start from the model that sees, in the minutes the see stage left
  INIT=$WORK/seeing
  MINUTES=$(python3 -c "print(round(max(0.5, $MINUTES - ($(date +%s) - $t0) / 60), 2))")
  echo "see stage done in $(( $(date +%s) - t0 )) s; SFT from $INIT for $MINUTES minutes"
  STAGE=sft
fi

if [ "$STAGE" = sft ]; then
  # SIZES and SFT_LRS pick the variants; INIT: a model folder to continue from (a start.tar unpacked in WORK);
  # ROUND: a prefix for this round's folders
  declare -A VARIANTS=()
  for size in ${SIZES:-7 9}; do
    for lr in ${SFT_LRS:-1e-3 3e-4}; do
      sizes="SIZE$size[*]"
      if [ -n "${VARIANTS_SPEC:-}" ]; then
        # VARIANTS_SPEC="name:key=value,key=value name2:...": these variants, each at every size and rate
        for spec in $VARIANTS_SPEC; do
          extra=${spec#*:}
          VARIANTS[${ROUND:-}${spec%%:*}_s${size}_lr$lr]="${!sizes} sft.lr=$lr ${extra//,/ }${INIT:+ model.path=$INIT}"
        done
      else
        VARIANTS[${ROUND:-}s${size}_lr$lr]="${!sizes} sft.lr=$lr${INIT:+ model.path=$INIT}"
      fi
    done
  done
  for name in "${!VARIANTS[@]}"; do
    # shellcheck disable=SC2086
    python scripts/sft.py "$CFG" "$WORK/sft_$name" ${VARIANTS[$name]} "${SFT_ARGS[@]}" --warmup "${WARMUP:-50}" \
      --max-minutes "$MINUTES" --stop-above "${STOP_ABOVE:-0}" > "$WORK/sft_$name.log" 2>&1 &
  done
  wait
  for name in "${!VARIANTS[@]}"; do
    cp "$WORK/sft_$name/sft_log.jsonl" "$OUT/sft_$name.jsonl" 2>/dev/null || tail -30 "$WORK/sft_$name.log"
    echo "${VARIANTS[$name]}" | sed 's/ model.path=[^ ]*//' > "$WORK/sft_$name/overrides.txt"
  done
  python - "$WORK" <<'PY'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
best = None
print("\n=== SFT: held-out greedy solve rate by step (64 mazes) ===")
for run in sorted(work.glob("sft_*/sft_log.jsonl")):
    evals = [e for e in map(json.loads, run.read_text().splitlines()) if "eval_solve_rate" in e]
    # step:solve rate/share of first move attempts into an open cell (perception; app.diagnosis)
    print(run.parent.name, " ".join(f"{e['sft_step']}:{e['eval_solve_rate']:.2f}/{e.get('eval_why_first_try_open', 0):.2f}"
                                    for e in evals))
    for e in evals:
        folder = run.parent / f"step_{e['sft_step']}"
        if e["eval_solve_rate"] <= 0.5 and folder.is_dir() and (best is None or e["eval_solve_rate"] > best[0]):
            best = (e["eval_solve_rate"], folder, e)
if best is None:
    sys.exit("no checkpoint to start GRPO from")
rate, folder, e = best
overrides = (folder.parent / "overrides.txt").read_text().strip()
(work / "choice.env").write_text(f'START="{folder.relative_to(work)}"\nOVERRIDES="{overrides}"\nSFT_STEP={e["sft_step"]}\n'
                                 f'SFT_ELAPSED_S={e["elapsed_s"]}\nSTART_RATE={rate}\n')
print(f"chosen: {folder} (held-out solve rate {rate:.3f} after {e['sft_step']} steps, {e['elapsed_s']:.0f} s)")
PY
  if [ -f "$WORK/choice.env" ]; then
    cp "$WORK/choice.env" "$OUT/"
    # shellcheck disable=SC1091
    . "$WORK/choice.env"
    tar -C "$WORK" -cf "$WORK/start.tar" "$START" choice.env  # unpack into WORK on a fresh machine
    split -b 15M "$WORK/start.tar" "$OUT/start.tar."
  fi
  exit 0
fi

# ---------------------------------------------------------------- grpo (and the continued-SFT control)
[ -f "$WORK/choice.env" ] || { echo "no $WORK/choice.env: run the sft stage, or unpack its start.tar into $WORK"; exit 2; }
# shellcheck disable=SC1091
. "$WORK/choice.env"  # START (relative to WORK), OVERRIDES, SFT_STEP, SFT_ELAPSED_S, START_RATE
read -r -a OVR <<< "$OVERRIDES"
n=$(ls -d "$WORK"/control_*/ 2>/dev/null | wc -l)
CONTROL_INIT=$WORK/$START
[ "$n" -gt 0 ] && CONTROL_INIT="$WORK/control_$n/final"
sft_lr=$(printf '%s\n' "${OVR[@]}" | sed -n 's/^sft.lr=//p')
python scripts/sft.py "$CFG" "$WORK/control_$((n + 1))" "${OVR[@]}" model.path="$CONTROL_INIT" train.seed=$((43 + n)) \
  "${SFT_ARGS[@]}" --warmup 10 --max-minutes "$MINUTES" > "$WORK/control_$((n + 1)).log" 2>&1 &
control=$!
timeout "$(python3 -c "print(int($MINUTES * 60 + 90))")" python -m app.main "$CFG" run_name=learn "${OVR[@]}" model.path="$WORK/$START" \
  sft.steps=0 output_dir="$WORK/runs" "${EXTRA[@]}" > "$OUT/grpo_$((n + 1)).log" 2>&1
echo "app.main exit code $?"
wait $control
cat "$WORK"/control_*/sft_log.jsonl > "$OUT/control.jsonl"
cp "$WORK/runs/learn/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
tail -5 "$WORK/control_$((n + 1)).log"
grep -E "^step|Error" "$OUT/grpo_$((n + 1)).log" | tail -25
python - "$OUT" "$sft_lr" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("\n=== held-out greedy solve rate: GRPO (by step) vs continued SFT (by step), both from the same checkpoint ===")
grpo = [json.loads(l) for l in (out / "grpo_metrics.jsonl").read_text().splitlines()] if (out / "grpo_metrics.jsonl").exists() else []
print("grpo   ", " ".join(f"{m['step']}:{m['eval_solve_rate']:.2f}" for m in grpo if "eval_solve_rate" in m))
ctrl = [json.loads(l) for l in (out / "control.jsonl").read_text().splitlines()]
print("control", " ".join(f"{m['sft_step']}@{m['elapsed_s']:.0f}s:{m['eval_solve_rate']:.2f}" for m in ctrl if "eval_solve_rate" in m))
PY
