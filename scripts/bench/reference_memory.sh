#!/usr/bin/env bash
# The reference run's trainer memory on one H200, gradient checkpointing on and off.
#   bash scripts/bench/reference_memory.sh OUT [WORK] [on|off|both]
# Qwen3-VL-8B's shape (random bf16 weights, built at WORK/model_8b if absent), LoRA r32 started from an
# adapter_init (a PEFT folder made here, WORK/adapter_8b), the reference context of configs/hyperpod.yaml (9x9
# mazes at 25 px, 15 turns with the whole history, 64-token replies, micro batch 4), one vLLM engine at
# gpu_memory_utilization 0.45 that sleeps while one trainer rank trains beside it on the same GPU. The GPU's used
# memory is sampled every 0.2 s (nvidia-smi); the table gives its peak inside the train phase (what a 96 GB GPU
# must hold), the trainer's own peak (train_peak_memory_gb) and the phase times. One step a setting: a step's
# train phase at this context is what the question is about; 2 mazes x 8 runs keep the rollout short.
set -uo pipefail
OUT=${1:?out dir}; WORK=${2:-/tmp/mazerl}; WHICH=${3:-both}
mkdir -p "$OUT" "$WORK"
export RAY_AUTH_MODE=disabled VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
[ -f "$WORK/model_8b/config.json" ] || python scripts/make_model.py "$WORK/model_8b" --shape 8b
[ -f "$WORK/adapter_8b/adapter_config.json" ] || python - "$WORK/model_8b" "$WORK/adapter_8b" <<'PY'
import sys, torch
from app.config import LoraSettings
from app.model.load import apply_lora, load_model
model = apply_lora(load_model(sys.argv[1], "bfloat16", "cuda"), LoraSettings(rank=32, alpha=64))
for name, p in model.named_parameters():
    if "lora_B" in name:
        torch.nn.init.normal_(p, std=1e-3)  # a warm start is not zero: the first sync carries real tensors
model.save_pretrained(sys.argv[2])
print("adapter_init written:", sys.argv[2])
PY
settings=(on off); [ "$WHICH" = both ] || settings=("$WHICH")
for gc in "${settings[@]}"; do
  flag=$([ "$gc" = on ] && echo true || echo false)
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/gpu_mem_$gc.csv" &
  sampler=$!
  timeout 540 python -m app.main configs/hyperpod.yaml run_name="mem-$gc" output_dir="$WORK/runs" \
    model.path="$WORK/model_8b" model.adapter_init="$WORK/adapter_8b" model.gradient_checkpointing="$flag" \
    placement.num_bundles=1 placement.cpus_per_bundle=8 placement.ray_address=null \
    placement.wait_for_resources_s=120 checkpoint.export_dir= checkpoint.s3_uri=null checkpoint.ckpt_interval=0 \
    checkpoint.hf_save_interval=0 eval.at_start=false eval.eval_interval=0 eval.num_mazes=2 \
    train.max_steps=1 train.mazes_per_step=2 rollout.enforce_eager=true metrics.progress_bar=false \
    > "$OUT/run_$gc.log" 2>&1
  echo "gradient checkpointing $gc: exit code $?"
  kill "$sampler"; wait "$sampler" 2>/dev/null
  cp "$WORK/runs/mem-$gc/metrics.jsonl" "$OUT/metrics_$gc.jsonl" 2>/dev/null
  grep -E "Error|error" "$OUT/run_$gc.log" | tail -5
done
python - "$OUT" <<'PY'
import csv, datetime, json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("\n=== trainer memory at the reference context (one H200, engine asleep beside the trainer) ===")
print(f"{'checkpointing':>13} {'GPU used peak in train (GB)':>28} {'trainer peak (GiB)':>19} {'train s':>8} "
      f"{'rollout s':>9} {'tokens':>8}")
for gc in ("on", "off"):
    metrics = out / f"metrics_{gc}.jsonl"
    if not metrics.exists():
        continue
    step = next(m for m in map(json.loads, metrics.read_text().splitlines()) if "train_loss" in m)
    start = step["train_started_at"]
    end = start + step["train_train_step_s"]
    used = []
    for row in csv.reader((out / f"gpu_mem_{gc}.csv").read_text().splitlines()):
        when = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        if start <= when <= end:
            used.append(int(row[1]) * 1.048576e6 / 1e9)
    print(f"{gc:>13} {max(used, default=float('nan')):>28.1f} {step.get('train_peak_memory_gb', float('nan')):>19.1f} "
          f"{step['time_train_s']:>8.1f} {step['time_rollout_s']:>9.1f} {step.get('train_forward_tokens', 0):>8.0f}")
PY
