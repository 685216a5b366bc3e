"""The trainer's log-probabilities against a vLLM engine's, with the LoRA computed in the model's dtype (what the
trainer does: app/learning/forward.py, with its fused layers, app/learning/speedups/lora_forward.py, and with
PEFT's own layer forward) and in float32 (PEFT's default for float32 adapter weights).

For each count of supervised steps (so that the adapter is not near zero), the trainer trains the LoRA, the engine
takes it in memory and plays 16 episodes at temperature 1, and the trainer scores them both ways in one train step
each at learning rate 0 (the weights do not move): the mean and max |trainer - engine| log-probability over the
trained tokens, as the loop reports them. The tiny model by default; on a GPU (--device cuda) the bf16 kernels of both.

    python scripts/bench/lora_precision.py [--sft-steps 5 10 20] [--device cpu] [--model tiny|PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile

WAYS = ("model dtype", "model dtype, PEFT's layers", "float32")


def mismatch_each_way(trainer, trajectories) -> dict[str, dict]:
    """One train step at learning rate 0 per way (WAYS): the trainer's, then without its fused LoRA layers, then with
    the LoRA in float32 as PEFT casts it."""
    from app.learning.speedups.lora_forward import fuse_lora_layers, restore_lora_layers

    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    trainer.scheduler.base_lrs = [0.0] * len(trainer.scheduler.base_lrs)
    results = [trainer.train_step(trajectories)]
    restore_lora_layers(trainer.model)
    results.append(trainer.train_step(trajectories))
    trainer.forward.mixed_precision = contextlib.nullcontext  # PEFT's own casting: float32 LoRA products
    results.append(trainer.train_step(trajectories))
    del trainer.forward.mixed_precision
    fuse_lora_layers(trainer.model)
    keys = ("logprob_mismatch_mean", "logprob_mismatch_max", "trained_tokens")
    return {way: {k: r[k] for k in keys} for way, r in zip(WAYS, results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny", help="model.path: tiny builds the tiny model")
    ap.add_argument("--cache", default=None, help="where the tiny model is built (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="also write the results as JSON lines here")
    args = ap.parse_args()

    from app.config import load_config
    from app.learning.sft import demonstrations
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.vllm import VLLMEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    cfg = load_config(
        None,
        ["model.dtype=bfloat16", f"model.path={args.model}", "lora.rank=16", "lora.alpha=32", "train.micro_batch=8"]
        + ["train.update_epochs=1", "rollout.engine=vllm"],
        check_paths=False,
    )
    cache = args.cache or tempfile.mkdtemp(prefix="lora-precision-")
    model_dir = str(ensure_model(cfg.model, cache))
    settings = EpisodeSettings(4, 7, 32, 0, 4096)
    lines = []
    engine = VLLMEngine(model_dir, cfg.lora, dtype="bfloat16", max_model_len=4096, max_images=16)
    try:
        for steps in args.sft_steps:
            trainer = PolicyTrainer(cfg, model_dir, device=args.device)
            shown = demonstrations([generate_maze(s, 7) for s in range(8)], trainer.codec, settings)
            for _ in range(steps):
                trainer.sft_step(shown, 3e-3)
            engine.load_lora(trainer.trained_tensors(), steps + 1)
            requests = [EpisodeRequest(generate_maze(100 + g, 7), g, s) for g in range(4) for s in range(4)]
            played = play_episodes(engine, trainer.codec, requests, settings, Sampling(8, 1.0, seed=3))
            played = [dataclasses.replace(t, reward=float(t.sample % 2)) for t in played]
            result = {"sft_steps": steps, **mismatch_each_way(trainer, played)}
            lines.append(result)
            print(json.dumps(result), flush=True)
    finally:
        engine.shutdown()
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    print(f"{'sft steps':>9} " + " ".join(f"{w:>28}" for w in WAYS) + "   (mean |trainer - engine| logprob)")
    for r in lines:
        print(f"{r['sft_steps']:9d} " + " ".join(f"{r[w]['logprob_mismatch_mean']:28.3e}" for w in WAYS))
    for way in WAYS[:2]:
        ratios = [r[way]["logprob_mismatch_mean"] / max(r["float32"]["logprob_mismatch_mean"], 1e-12) for r in lines]
        print(f"{way} / float32, median of {len(ratios)}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
