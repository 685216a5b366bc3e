#!/usr/bin/env bash
# The full colocated loop on 2 H200s: 2 vLLM rollout actors + 2 FSDP2 trainer ranks (NCCL), one bundle
# per GPU, sleep/wake between phases; one model per call so that each call fits the 10-minute limit.
#   [BUNDLES=1] bash scripts/bench/loop.sh OUT [WORK] [tiny|8b]
# BUNDLES (default 2): GPUs used, one rollout actor + one trainer rank sharing each (1: both on one H200).
# tiny: the tiny model (3 steps, eval, checkpoint). 8b: the Qwen3-VL-8B-shaped model with random bf16
# weights at WORK/model_8b (built if absent), LoRA r32, 2 steps and a full checkpoint. Logs and the
# metrics log land in OUT; a table of the step anatomy is printed last. EXTRA: more overrides for the run.
set -uo pipefail
OUT=${1:?out dir}; WORK=${2:-/tmp/mazerl}; WHICH=${3:-tiny}
mkdir -p "$OUT" "$WORK"
export RAY_AUTH_MODE=disabled VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
COMMON=(output_dir="$WORK/runs" placement.num_bundles=${BUNDLES:-2} placement.cpus_per_bundle=6 metrics.progress_bar=false
        eval.num_mazes=16 checkpoint.hf_save_interval=0)
if [ "$WHICH" = tiny ]; then
  timeout 500 python -m app.main configs/h200.yaml run_name=tiny-gpu "${COMMON[@]}" train.max_steps=3 \
    train.mazes_per_step=16 eval.eval_interval=3 checkpoint.ckpt_interval=3 > "$OUT/loop_tiny.log" 2>&1
  echo "exit code $?"; grep -E "^step|Error|error" "$OUT/loop_tiny.log" | tail -20
else
  [ -f "$WORK/model_8b/config.json" ] || python scripts/make_model.py "$WORK/model_8b" --shape 8b
  timeout 520 python -m app.main configs/h200.yaml run_name=8b-gpu model.path="$WORK/model_8b" "${COMMON[@]}" \
    train.max_steps=2 train.mazes_per_step=8 train.micro_batch=4 eval.eval_interval=0 eval.at_start=false \
    checkpoint.ckpt_interval=2 rollout.max_turns=13 ${EXTRA:-} > "$OUT/loop_8b.log" 2>&1
  echo "exit code $?"; grep -E "^step|Error|error" "$OUT/loop_8b.log" | tail -20
fi
for run in tiny-gpu 8b-gpu; do
  [ -f "$WORK/runs/$run/metrics.jsonl" ] && cp "$WORK/runs/$run/metrics.jsonl" "$OUT/metrics_$run.jsonl"
done
python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
keys = ["time_rollout_s", "time_train_s", "time_sync_s", "time_eval_s", "time_checkpoint_s", "time_step_s",
        "rollout_generated_tokens_per_s", "train_trained_tokens", "train_train_step_s", "train_logprob_mismatch_mean",
        "train_logprob_mismatch_max", "peak_rss_bytes", "adapter_bytes", "optimizer_bytes", "eval_solve_rate",
        "rollout_mfu", "train_mfu", "rollout_floor_s", "train_floor_s", "rollout_tflop", "train_tflop"]
print("\n=== loop ===")
for f in sorted(out.glob("metrics_*.jsonl")):
    for line in f.read_text().splitlines():
        m = json.loads(line)
        if "train_loss" in m:
            print(f.stem, m["step"], " ".join(f"{k.replace('time_', '')}={m[k]:.4g}" for k in keys if k in m))
PY
