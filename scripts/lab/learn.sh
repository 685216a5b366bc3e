#!/usr/bin/env bash
# The learning run on one H200 (docs/RESULTS.md), in stages that each fit one 10-minute device call.
#   bash scripts/lab/learn.sh see  OUT WORK MINUTES
#       first teach the model of scripts/lab/configs/learn_h200.yaml (random weights) to see walls: scripts/lab/perception_probe.py
#       on open-move questions alone (SEE_BATCH=256 a step: on the H200 a step is host-bound, so 4x the 64 of the fourth
#       attempt costs ~nothing and reached 0.91 in 8.4 minutes, docs/RESULTS.md), alone on the GPU, until the held-out exact-answer
#       probability passes SEE_ABOVE (0.95) or time runs out; saves WORK/seeing, which the sft stage starts from
#       (INIT=WORK/seeing). SEE_CACHE_GB (16) keeps every training picture processed on the GPU. SEE_ROOMS: the share
#       of questions asked in rooms, where the answer takes seeing walls (perception_probe.py --rooms; default: any cell).
#       SEE_VARIANTS="name:--flag=value,key=value ...": several see stages side by side, each with its own flags after
#       the common ones (e.g. rooms:--rooms=0.8); the first past SEE_ABOVE wins and the others stop. They share the GPU:
#       at 256 questions a step each runs ~2.5x slower (docs/BENCHMARKS.md), so this compares settings, it saves no time.
#   bash scripts/lab/learn.sh see+sft OUT WORK MINUTES
#       both in one call: see for at most SEE_MINUTES (default all of MINUTES), then sft from WORK/seeing for the rest.
#   bash scripts/lab/learn.sh sft  OUT WORK MINUTES
#       full-model SFT of the small Qwen3-VL in scripts/lab/configs/learn_h200.yaml from random weights (or from INIT),
#       variants side by side on the one GPU (SIZES="7 9" mazes x SFT_LRS="1e-3 3e-4", x VARIANTS_SPEC), each saving and
#       evaluating a checkpoint every EVAL_EVERY (25) steps (STOP_ABOVE: stop a variant once it passes that rate;
#       FINE_EVAL="RATE K": every K steps once a reading passes RATE).
#       Picks the start of GRPO among the checkpoints <= 50% (scripts/lab/choose_start.py): CHOOSE=seeing (default)
#       the one with the most move attempts into open cells, CHOOSE=rate the highest solve rate (SEEING_AT_LEAST: of
#       the checkpoints with at least that share of move attempts into open cells; START_AT_MOST: a bound below 0.5, since
#       the GRPO run's own step-0 reading under vLLM in bfloat16 differs by a point or two; FINE_EVAL: below); writes
#       WORK/choice.env and packs it into OUT/start.tar.* (to carry on); exits 4 when no checkpoint qualifies.
#   bash scripts/lab/learn.sh sft+grpo OUT WORK MINUTES
#       both in one call: sft for SFT_MINUTES, then grpo (below) for the rest of MINUTES.
#   bash scripts/lab/learn.sh grpo OUT WORK MINUTES
#       GRPO (app.main, vLLM rollouts, LoRA r32) from the chosen checkpoint, resuming from its latest
#       checkpoint when WORK holds one; beside it on the same GPU the control: the same checkpoint's SFT
#       continued for the same wall time (continuing the previous control when there is one). CONTROL_TRAINS: which
#       controls, one or both side by side: full (the default) trains every weight merged (WORK/control_K, OUT/control.jsonl);
#       same trains what the GRPO run trains (its LoRA, and the vision tower when EXTRA has lora.modules_to_save=[visual],
#       every weight with [visual,language_model]) from the same start (WORK/control_same_K, OUT/control_same.jsonl);
#       "same full": both, the fair control and the full-model line (CONTROL_GPU_SHARE=F: each keeps to F of the GPU's
#       memory; on an 80 GB card with both, 0.3: at 0.2 each
#       ran out of its 15.8 GiB before its first evaluation). The stage takes
#       ~MINUTES + 1.7 minutes (engine start, the control's last evaluation and save; 5.0 took 403 s): in a
#       10-minute device call that also installs the wheels keep MINUTES <= 7.3 (7.6 ran past the call's limit
#       before the table printed). A GRPO run with CUDA graphs (rollout.enforce_eager=false, as scripts/lab/configs/learn_h200.yaml
#       has it) that fails goes on without them for the minutes left (RETRY_EXTRA="key=value ...": with these
#       instead). PROFILE_AFTER=S: py-spy samples of the rollout actor and trainer rank 0,
#       S seconds in, into OUT/profile_*.txt (scripts/bench/profile_summary.py reads them). At its end the stage packs the run
#       so far, less the start model, as OUT/delta.tar.* (4 pieces of <= 15 MiB for scripts/lab/configs/learn_h200.yaml; SAVE_DELTA=0:
#       not): a machine lost between calls loses no steps. Here, unpack the carried state's pieces and the delta's
#       together (below), then pack that folder to carry the whole state on.
#   bash scripts/lab/learn.sh start OUT WORK MINUTES
#       the grpo stage (above) detached in a process session of its own, returning at once: it outlives the device
#       call (the device keeps setsid processes until the machine goes back), so one engine start serves a whole
#       session instead of one each call (~150 s of every 10-minute call on a fresh machine, ~100 s on a warm one).
#       Its OUT is WORK/detached_out. Make the calls after it back to back (the machine goes back after 30 s idle):
#   bash scripts/lab/learn.sh watch OUT WORK SECONDS
#       waits until the detached stage ends or SECONDS pass, then copies its logs and metrics into OUT and packs the
#       run so far (latest complete GRPO checkpoint, the controls' logs and newest model) as OUT/delta.tar.*; prints
#       the table and any control that stopped on an error (its last error line: its log stays in WORK); exit 3 while
#       the stage runs on, 0 once it has ended. Keep SECONDS <= 560 in a 10-minute call.
#   bash scripts/lab/learn.sh pack OUT WORK
#       what a fresh machine needs to go on with GRPO and its control where this one stopped (choice.env, the start
#       model, the latest GRPO checkpoint and metrics, the controls' logs and latest model) as OUT/state.tar.* pieces
#       of <= 15 MiB; copy them here into .carry/ (git-ignored), carry them back (carry: [".carry/state.tar.aa", ...],
#       3 pieces a device call: 4 and the repo's own files pass the 64 MiB a call may carry) and copy them into one
#       folder there, then
#   bash scripts/lab/learn.sh unpack PIECES WORK
#       unpacks PIECES/start.tar.* (the sft stage's), PIECES/state.tar.* and PIECES/delta.tar.* (the grpo stage's, on top
#       of the state it continues), those there are, into WORK: the grpo stage then resumes.
#       Unpack into the same WORK path: the GRPO run's config names its start model by path.
# Smoke test on a CPU: DEVICE=cpu EVAL_EVERY=1 EXTRA="eval.num_mazes=2 sft.mazes_per_step=2 ..." (the grpo stage
# then needs EXTRA to hold placement.gpus_per_bundle=0 model.dtype=float32 too).
# Logs and metrics land in OUT (at most 8 files come back from a device call); a table is printed last.
set -uo pipefail
STAGE=${1:?see|see+sft|sft|sft+grpo|grpo|start|watch|pack|unpack}; OUT=${2:?out dir}; WORK=${3:?work dir}
mkdir -p "$OUT" "$WORK"
CONTROL_PREFIXES=(control_ control_same_)  # the folders of the two kinds of control: full and same (CONTROL_TRAINS)
control_prefix() { [ "$1" = same ] && echo control_same_ || echo control_; }
control_rounds() { ls -d "$WORK/$1"[0-9]*/ 2>/dev/null | sed "s|.*/$1\([0-9]*\)/\$|\1|" | sort -n; }  # PREFIX's K
newest_control_model() {  # newest_control_model PREFIX: that kind's newest model folder, relative to WORK (or nothing)
  # a control's final/ once it has ended; while it runs (a detached stage, watched) its newest step_K/ save
  local prefix=$1 k step
  for k in $(control_rounds "$prefix" | sort -rn); do
    [ -d "$WORK/$prefix$k/final" ] && { echo "$prefix$k/final"; return; }
    step=$(ls -d "$WORK/$prefix$k"/step_*/ 2>/dev/null | sed 's|.*/step_\([0-9]*\)/$|\1|' | sort -rn | head -1)
    [ -n "$step" ] && { echo "$prefix$k/step_$step"; return; }
  done
}
control_failures() {  # each kind's newest control that stopped on an error: its folder and its last error line
  local prefix k
  for prefix in "${CONTROL_PREFIXES[@]}"; do
    k=$(control_rounds "$prefix" | tail -1)
    [ -n "$k" ] && grep -q "^Traceback" "$WORK/$prefix$k.log" 2>/dev/null &&
      echo "control $prefix$k failed: $(grep -E "^[A-Za-z_.]*(Error|Exception)" "$WORK/$prefix$k.log" | tail -1)"
  done
  return 0
}
copy_control_logs() {  # copy_control_logs OUT: each kind's logs, rounds in order: OUT/control.jsonl, control_same.jsonl
  local prefix k
  for prefix in "${CONTROL_PREFIXES[@]}"; do
    [ -n "$(control_rounds "$prefix")" ] || continue
    for k in $(control_rounds "$prefix"); do cat "$WORK/$prefix$k/sft_log.jsonl" 2>/dev/null; done > "$1/${prefix%_}.jsonl"
  done
}
pack_state() {  # pack_state DEST KIND WITH_START: what going on needs as DEST/KIND.tar.* pieces
  local dest=$1 kind=$2 with_start=$3 run=runs/learn prefix k
  # shellcheck disable=SC1091
  . "$WORK/choice.env"
  local files=(choice.env)
  [ "$with_start" = 1 ] && files+=("$START")
  [ -f "$WORK/$run/checkpoints/latest" ] && files+=("$run/metrics.jsonl" "$run/checkpoints/latest"
                                                    "$run/checkpoints/$(cat "$WORK/$run/checkpoints/latest")")
  for prefix in "${CONTROL_PREFIXES[@]}"; do
    for k in $(control_rounds "$prefix"); do
      [ -f "$WORK/$prefix$k/sft_log.jsonl" ] && files+=("$prefix$k/sft_log.jsonl")
    done
    k=$(newest_control_model "$prefix")
    [ -n "$k" ] && files+=("$k")
  done
  mkdir -p "$dest" && rm -f "$dest/$kind.tar."*
  # equal pieces of at most 15 MiB: as few files as can be (a device call returns 8 files, 16 MiB each)
  tar -C "$WORK" -cf "$WORK/$kind.tar" "${files[@]}" || return 1
  split -n "$(( ($(stat -c %s "$WORK/$kind.tar") + 15728639) / 15728640 ))" "$WORK/$kind.tar" "$dest/$kind.tar."
  rm -f "$WORK/$kind.tar"
}
summary() {  # the held-out table of GRPO and its controls, from OUT's grpo_metrics.jsonl and control*.jsonl
python - "$1" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("\n=== held-out greedy solve rate / first_try_open: GRPO (by step) vs continued SFT (by step), from the same "
      "checkpoint ===")
grpo = [json.loads(l) for l in (out / "grpo_metrics.jsonl").read_text().splitlines()] if (out / "grpo_metrics.jsonl").exists() else []
def rate_and_seeing(m):  # greedy solve rate / first_try_open, and the sampled solve rate with eval.samples
    sampled = f"(s{m['eval_sampled_solve_rate']:.2f})" if "eval_sampled_solve_rate" in m else ""
    return f"{m['eval_solve_rate']:.2f}/{m.get('eval_why_first_try_open', 0):.2f}{sampled}"
print("grpo   ", " ".join(f"{m['step']}:{rate_and_seeing(m)}" for m in grpo if "eval_solve_rate" in m))
for name, label in (("control.jsonl", "control"), ("control_same.jsonl", "control (GRPO's trainable set)")):
    if (out / name).exists():
        ctrl = [json.loads(l) for l in (out / name).read_text().splitlines()]
        print(label, " ".join(f"{m['sft_step']}@{m['elapsed_s']:.0f}s:{rate_and_seeing(m)}" for m in ctrl if "eval_solve_rate" in m))
PY
}
if [ "$STAGE" = pack ]; then
  [ -f "$WORK/choice.env" ] || { echo "no $WORK/choice.env: nothing to pack"; exit 2; }
  pack_state "$OUT" state 1
  ls -l "$OUT"/state.tar.*
  exit 0
fi
if [ "$STAGE" = unpack ]; then
  found=0
  for kind in start state delta; do  # in this order: a delta goes on top of the state it continues
    compgen -G "$OUT/$kind.tar.*" > /dev/null || continue
    cat "$OUT/$kind.tar."* | tar -C "$WORK" -xf - && found=1 || { echo "$kind.tar.* in $OUT does not unpack"; exit 2; }
  done
  [ "$found" = 1 ] || { echo "no start.tar.*, state.tar.* or delta.tar.* pieces in $OUT"; exit 2; }
  ls "$WORK"
  exit 0
fi
if [ "$STAGE" = start ]; then
  # the grpo stage in a process session of its own: the device keeps such a process when the call that started it
  # returns, until the machine goes back, so one engine start serves the whole session and later calls watch it
  [ -f "$WORK/detached.pid" ] && kill -0 "$(cat "$WORK/detached.pid")" 2>/dev/null &&
    { echo "a detached stage already runs in $WORK (pid $(cat "$WORK/detached.pid"))"; exit 2; }
  rm -f "$WORK/detached.pid"  # an ended stage's: the wait below must read the new one's
  setsid nohup bash -c 'echo $$ > "$1/detached.pid"; exec bash "$2" grpo "$1/detached_out" "$1" "$3"' _ \
    "$WORK" "$(readlink -f "$0")" "${4:?minutes}" > "$WORK/detached.log" 2>&1 < /dev/null &
  for _ in 1 2 3 4 5; do [ -s "$WORK/detached.pid" ] && break; sleep 1; done
  echo "the grpo stage runs detached (pid $(cat "$WORK/detached.pid")) for $4 minutes + its start;" \
       "follow it with: learn.sh watch OUT $WORK SECONDS"
  exit 0
fi
if [ "$STAGE" = watch ]; then
  # follow the detached stage for at most SECONDS, then bring its logs, metrics and the run so far (OUT/delta.tar.*,
  # from the latest complete checkpoints) into OUT: a machine lost after this call loses only the steps after it
  pid=$(cat "$WORK/detached.pid" 2>/dev/null) || { echo "no detached stage in $WORK: learn.sh start first"; exit 2; }
  t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "${4:?seconds}" ]; do sleep 5; done
  running=0; kill -0 "$pid" 2>/dev/null && running=1
  cp "$WORK"/detached_out/grpo_*.log "$OUT"/ 2>/dev/null
  cp "$WORK/runs/learn/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
  copy_control_logs "$OUT"
  # a checkpoint can commit while tar reads: once more on failure (keep_last 3 keeps the one read meanwhile)
  pack_state "$OUT" delta 0 2>/dev/null || { sleep 5; pack_state "$OUT" delta 0; }
  echo "delta: $(ls "$OUT"/delta.tar.* | wc -l) pieces, $(cat "$OUT"/delta.tar.* | wc -c) bytes, control models" \
       "$(newest_control_model control_) $(newest_control_model control_same_)"
  grep -h -E "^step|Error" "$OUT"/grpo_*.log | tail -15
  control_failures  # a control that died while the stage runs on: its logs stay in WORK
  summary "$OUT"
  [ "$running" = 1 ] && { echo "the detached stage runs on (pid $pid)"; exit 3; }
  tail -3 "$WORK/detached.log"
  echo "the detached stage has ended"
  exit 0
fi
MINUTES=${4:?minutes}
export RAY_AUTH_MODE=disabled VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=3
CFG=${CONFIG:-scripts/lab/configs/learn_h200.yaml}  # CONFIG: another config (a CPU smoke test takes configs/tiny.yaml)
SIZE7=(maze.size=7 rollout.max_turns=25 train.dataset_size=704)
SIZE9=(maze.size=9 rollout.max_turns=25 train.dataset_size=20000)
# EXTRA: more key=value overrides for every run; DEVICE and EVAL_EVERY: for a smoke test on a CPU
read -r -a EXTRA <<< "${EXTRA:-}"
# FINE_EVAL="RATE K": evaluate every K steps once a reading passes RATE (scripts/sft.py --fine-eval), for a start
# just under START_AT_MOST (0.5: issue #7's bound) without dense readings all the way there
read -r -a FINE <<< "${FINE_EVAL:-}"
SFT_ARGS=(model.dtype=float32 rollout.engine=hf output_dir="$WORK/runs" "${EXTRA[@]}" --full --device "${DEVICE:-cuda}"
          --eval-every "${EVAL_EVERY:-25}" ${FINE_EVAL:+--fine-eval "${FINE[@]}"})

if [ "$STAGE" = see ] || [ "$STAGE" = see+sft ]; then
  t0=$(date +%s)
  SEE_COMMON=(model.dtype=float32 output_dir="$WORK/runs" train.picture_cache_gb="${SEE_CACHE_GB:-16}" "${EXTRA[@]}"
              --device "${DEVICE:-cuda}" --batch "${SEE_BATCH:-256}" --lr "${SEE_LR:-3e-4}"
              --eval-every "${SEE_EVAL_EVERY:-25}" --steps 1000000 --max-minutes "${SEE_MINUTES:-$MINUTES}"
              --stop-above "${SEE_ABOVE:-0.95}" ${SEE_ROOMS:+--rooms "$SEE_ROOMS"})
  [ -L "$WORK/seeing" ] && rm "$WORK/seeing"  # a link to an earlier variant's model: this stage saves its own
  if [ -z "${SEE_VARIANTS:-}" ]; then
    python scripts/lab/perception_probe.py "$CFG" "$OUT/see.jsonl" "${SEE_COMMON[@]}" --save "$WORK/seeing" 2>&1 | grep -v "it/s]"
    rc=${PIPESTATUS[0]}
  else
    # SEE_VARIANTS="name:--flag=value,key=value name2:...": see stages side by side, each with its own flags or
    # overrides after the common ones; the first to pass SEE_ABOVE wins and the rest stop; when none does, the
    # highest last p_exact. WORK/seeing links to the winner's model.
    declare -A SEE_PIDS=()
    for spec in $SEE_VARIANTS; do
      name=${spec%%:*}; flags=${spec#*:}
      # shellcheck disable=SC2086
      python scripts/lab/perception_probe.py "$CFG" "$OUT/see_$name.jsonl" "${SEE_COMMON[@]}" ${flags//,/ } \
        --save "$WORK/seeing_$name" > "$WORK/see_$name.log" 2>&1 &
      SEE_PIDS[$name]=$!
    done
    while [ "${#SEE_PIDS[@]}" -gt 0 ]; do
      wait -n
      for name in "${!SEE_PIDS[@]}"; do
        kill -0 "${SEE_PIDS[$name]}" 2>/dev/null && continue
        unset "SEE_PIDS[$name]"
        tail -2 "$WORK/see_$name.log"
        if python3 scripts/lab/choose_seeing.py --passed "${SEE_ABOVE:-0.95}" "$OUT/see_$name.jsonl"; then
          echo "see variant $name passed ${SEE_ABOVE:-0.95}: the others stop"
          for other in "${!SEE_PIDS[@]}"; do kill "${SEE_PIDS[$other]}"; done
          wait; SEE_PIDS=(); break
        fi
      done
    done
    best=$(python3 scripts/lab/choose_seeing.py "$WORK" "$OUT"/see_*.jsonl)
    rc=$?
    [ "$rc" = 0 ] && ln -sfn "$WORK/seeing_$best" "$WORK/seeing" && echo "the see stage's model: variant $best"
  fi
  [ "$STAGE" = see ] && exit "$rc"
  [ "$rc" = 0 ] && [ -d "$WORK/seeing" ] || { echo "the see stage failed (exit $rc): no $WORK/seeing"; exit 2; }
  # see+sft: the warm start from the model that sees, in the minutes the see stage left
  INIT=$WORK/seeing
  MINUTES=$(python3 -c "print(round(max(0.5, $MINUTES - ($(date +%s) - $t0) / 60), 2))")
  echo "see stage done in $(( $(date +%s) - t0 )) s; SFT from $INIT for $MINUTES minutes"
  STAGE=sft
fi

GRPO_AFTER=0
if [ "$STAGE" = sft+grpo ]; then
  # SFT for SFT_MINUTES, then GRPO beside its control for the rest of MINUTES
  GRPO_AFTER=1; TOTAL_MINUTES=$MINUTES; MINUTES=${SFT_MINUTES:?sft+grpo needs SFT_MINUTES}; STAGE=sft
fi
t_sft=$(date +%s)
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
  python scripts/lab/choose_start.py "$WORK" --by "${CHOOSE:-seeing}" --seeing-at-least "${SEEING_AT_LEAST:-0}" \
    --most "${START_AT_MOST:-0.5}"
  chosen=$?
  [ -f "$WORK/choice.env" ] && cp "$WORK/choice.env" "$OUT/"
  if [ -f "$WORK/choice.env" ] && [ "$GRPO_AFTER" = 0 ]; then  # sft+grpo goes on here: nothing to carry
    # shellcheck disable=SC1091
    . "$WORK/choice.env"
    tar -C "$WORK" -cf "$WORK/start.tar" "$START" choice.env  # unpack into WORK on a fresh machine
    split -b 15M "$WORK/start.tar" "$OUT/start.tar."
  fi
  # no checkpoint qualified: fail, so that a stage chained after this one (&& learn.sh start) does not run
  [ "$chosen" = 0 ] || { echo "no GRPO start chosen (choose_start.py exit $chosen)"; exit 4; }
  [ "$GRPO_AFTER" = 1 ] || exit 0
  # sft+grpo: GRPO and its control from the chosen checkpoint, in the minutes the sft stage left
  MINUTES=$(python3 -c "print(round(max(0.5, $TOTAL_MINUTES - ($(date +%s) - $t_sft) / 60), 2))")
  echo "sft stage done; GRPO for $MINUTES minutes"
fi

# ---------------------------------------------------------------- grpo (and the continued-SFT control)
[ -f "$WORK/choice.env" ] || { echo "no $WORK/choice.env: run the sft stage, or unpack its start.tar into $WORK"; exit 2; }
# shellcheck disable=SC1091
. "$WORK/choice.env"  # START (relative to WORK), OVERRIDES, SFT_STEP, SFT_ELAPSED_S, START_RATE
read -r -a OVR <<< "$OVERRIDES"
read -r -a CONTROLS <<< "${CONTROL_TRAINS:-full}"
for kind in "${CONTROLS[@]}"; do
  [ "$kind" = full ] || [ "$kind" = same ] || { echo "CONTROL_TRAINS: full, same or \"same full\", not $kind"; exit 2; }
done
# this round's number: the rounds the first control kind has run, plus one (its log is OUT/grpo_ROUND.log)
round=$(( $(control_rounds "$(control_prefix "${CONTROLS[0]}")" | wc -l) + 1 ))
controls=()
for kind in "${CONTROLS[@]}"; do
  [ "${CONTROL:-1}" = 1 ] || break  # CONTROL=0: GRPO alone on the GPU (its speed without a neighbour; no new control)
  prefix=$(control_prefix "$kind")
  n=$(control_rounds "$prefix" | wc -l)
  newest=$(newest_control_model "$prefix")
  if [ "$kind" = full ]; then  # every weight, from the newest full model
    CONTROL_ARGS=(model.path="$WORK/${newest:-$START}" "${SFT_ARGS[@]}")
  else  # the GRPO run's trainable set (EXTRA's lora.*) as PEFT adapters on the start model
    CONTROL_ARGS=(model.path="$WORK/$START")
    [ -n "$newest" ] && [ -f "$WORK/$newest/adapter_config.json" ] && CONTROL_ARGS+=(model.adapter_init="$WORK/$newest")
    for a in "${SFT_ARGS[@]}"; do [ "$a" = --full ] || CONTROL_ARGS+=("$a"); done
  fi
  # CONTROL_GPU_SHARE: each control's bound on the GPU's memory (sft.py --gpu-share); unbound, two controls held
  # 28-31 GB each of an 80 GB card and starved the GRPO run beside them; each needs more than 0.2 of an 80 GB card
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/sft.py "$CFG" "$WORK/$prefix$((n + 1))" "${OVR[@]}" \
    train.seed=$((43 + n)) "${CONTROL_ARGS[@]}" --warmup 10 --max-minutes "$MINUTES" --gpu-share "${CONTROL_GPU_SHARE:-0}" \
    > "$WORK/$prefix$((n + 1)).log" 2>&1 &
  controls+=($!)
done
# the logs come back even when the device call's limit cuts this stage short
( while sleep 20; do
    cp "$WORK/runs/learn/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
    copy_control_logs "$OUT"
  done ) &
copier=$!
if [ -n "${PROFILE_AFTER:-}" ] && command -v py-spy > /dev/null; then
  # PROFILE_AFTER=S: S seconds in, sample the rollout actor and trainer rank 0 for PROFILE_SECONDS (45) with py-spy
  # (collapsed stacks, idle frames included: waits on the GPU show where they happen); scripts/bench/profile_summary.py
  # reads them
  ( sleep "$PROFILE_AFTER"
    for actor in RolloutActor TrainerActor; do
      pid=$(pgrep -f "ray::$actor" | head -1)
      [ -n "$pid" ] && py-spy record --pid "$pid" --duration "${PROFILE_SECONDS:-45}" --rate 100 --idle --nonblocking \
        --format raw --output "$OUT/profile_$actor.txt" > "$WORK/profile_$actor.log" 2>&1 &
    done; wait ) &
fi
grpo_call() {  # the GRPO run for $1 minutes, with any further overrides after it
  local minutes=$1; shift
  timeout "$(python3 -c "print(int($minutes * 60 + 90))")" python -m app.main "$CFG" run_name=learn "${OVR[@]}" \
    model.path="$WORK/$START" output_dir="$WORK/runs" "${EXTRA[@]}" sft.steps=0 "$@" >> "$OUT/grpo_$round.log" 2>&1
}
t_grpo=$(date +%s)
grpo_call "$MINUTES"
code=$?
echo "app.main exit code $code"
left=$(python3 -c "print(round($MINUTES - ($(date +%s) - $t_grpo) / 60, 2))")
# the run's own settings say whether it captured CUDA graphs (scripts/lab/configs/learn_h200.yaml does; EXTRA may say otherwise)
graphs=$(python -c "import sys; from app.config import load_config
print(int(not load_config(sys.argv[1], sys.argv[2:], check_paths=False).rollout.enforce_eager))" \
  "$CFG" "${OVR[@]}" "${EXTRA[@]}" 2>/dev/null || echo 0)
# RETRY_EXTRA: overrides for a second try after a failure, e.g. back to a setting that ran before (one engine
# instead of several: placement.rollouts_per_bundle=1 ...); without it, a run that captured CUDA graphs retries
# without them (an optimisation: an engine that fails with them goes on without, for the minutes left)
retry=()
if [ -n "${RETRY_EXTRA:-}" ]; then read -r -a retry <<< "$RETRY_EXTRA"; elif [ "$graphs" = 1 ]; then retry=(rollout.enforce_eager=true); fi
if [ "$code" != 0 ] && [ "${#retry[@]}" -gt 0 ] && python3 -c "import sys; sys.exit(0 if $left > 2 else 1)"; then
  if [ -n "${RETRY_EXTRA:-}" ]; then echo "GRPO failed (exit $code); again with RETRY_EXTRA (${retry[*]}) for $left minutes"
  else echo "GRPO failed with CUDA graphs (rollout.enforce_eager=false); again without them for $left minutes"; fi
  grpo_call "$left" "${retry[@]}"
  echo "app.main exit code $?"
fi
[ "${#controls[@]}" -gt 0 ] && wait "${controls[@]}"
kill $copier
copy_control_logs "$OUT"
cp "$WORK/runs/learn/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
# the run so far, less the start model the carried state already holds: a device machine lost between calls then
# loses no steps (unpack PIECES with the state's and these pieces together goes on from here)
[ "${SAVE_DELTA:-1}" = 1 ] && pack_state "$OUT" delta 0 && echo "delta: $(ls "$OUT"/delta.tar.* | wc -l) pieces, $(cat "$OUT"/delta.tar.* | wc -c) bytes"
if [ "${#controls[@]}" -gt 0 ]; then
  for kind in "${CONTROLS[@]}"; do
    prefix=$(control_prefix "$kind"); tail -5 "$WORK/$prefix$(control_rounds "$prefix" | tail -1).log"
  done
  control_failures
fi
grep -E "^step|Error" "$OUT/grpo_$round.log" | tail -25
summary "$OUT"
