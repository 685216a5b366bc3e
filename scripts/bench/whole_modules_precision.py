"""The trainer's log-probabilities against a bf16 vLLM engine's when whole modules train (lora.modules_to_save):
the LoRA alone, the vision tower beside it, every weight; the whole modules computed as bf16 copies of their float32
masters (what the trainer does: app.model.load.train_whole_modules) and as float32 masters under autocast only.

For each count of supervised steps (so that the trained weights have left their bf16 values), each trainable set
trains from the same start, the engine takes the trainer's every weight in memory and plays 16 episodes at
temperature 1, and the trainer scores them each way in one train step at learning rate 0: the mean |trainer - engine|
log-probability over the trained tokens, as the loop reports it. The tiny model by default. vLLM's bf16 kernels
differ from transformers' (its fused norms, its attention), which is most of its mismatch; the transformers engine
(--engine hf) computes as the trainer does, so there the mismatch is the trainer's arithmetic alone.

    python scripts/bench/whole_modules_precision.py [--sft-steps 5 20] [--engine vllm|hf] [--model tiny|PATH]
        [--cache DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile

SETS = {"lora": "[]", "tower": "[visual]", "every weight": "[visual,language_model]"}


def score(trainer, trajectories) -> float:
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    trainer.scheduler.base_lrs = [0.0] * len(trainer.scheduler.base_lrs)
    return trainer.train_step(trajectories)["logprob_mismatch_mean"]


def autocast_only(trainer) -> None:
    """The whole modules' float32 masters used as they are, under the forward's autocast (matrix products in bf16,
    norms, embeddings and the residual stream in float32)."""
    from torch.nn.utils import parametrize

    for module in trainer.model.modules():
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, nargs="+", default=[5, 20])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="the engine that plays, in bf16")
    ap.add_argument("--model", default="tiny", help="model.path: tiny builds the tiny model")
    ap.add_argument("--cache", default=None, help="where the tiny model is built (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="also write the results as JSON lines here")
    args = ap.parse_args()

    from app.config import load_config
    from app.learning.sft import demonstrations
    from app.learning.training import PolicyTrainer
    from app.model import adapters
    from app.model.build import ensure_model
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    def config(saved: str):
        base = ["model.dtype=bfloat16", f"model.path={args.model}", "lora.rank=16", "lora.alpha=32"]
        return load_config(None, [*base, "train.micro_batch=8", f"lora.modules_to_save={saved}"], check_paths=False)

    every = config(SETS["every weight"])
    model_dir = str(ensure_model(every.model, args.cache or tempfile.mkdtemp(prefix="whole-precision-")))
    settings = EpisodeSettings(4, 7, 32, 0, 4096)
    if args.engine == "vllm":
        from app.rollout.engines.vllm import VLLMEngine

        engine = VLLMEngine(model_dir, every.lora, dtype="bfloat16", max_model_len=4096, max_images=16)
    else:
        engine = HFEngine(model_dir, every.lora, dtype="bfloat16")
    lines, version = [], 0
    try:
        for steps in args.sft_steps:
            result = {"sft_steps": steps, "engine": args.engine}
            for name, saved in SETS.items():
                trainer = PolicyTrainer(config(saved), model_dir)
                shown = demonstrations([generate_maze(s, 7) for s in range(8)], trainer.codec, settings)
                for _ in range(steps):
                    trainer.sft_step(shown, 3e-3)
                held = adapters.normalize_keys(dict(trainer.model.named_parameters()))  # frozen weights included
                version += 1
                engine.load_lora({k: held[k].detach() for k in engine.spec.shapes}, version)
                requests = [EpisodeRequest(generate_maze(100 + g, 7), g, s) for g in range(4) for s in range(4)]
                played = play_episodes(engine, trainer.codec, requests, settings, Sampling(8, 1.0, seed=3))
                played = [dataclasses.replace(t, reward=float(t.sample % 2)) for t in played]
                result[name] = score(trainer, played)
                if saved != "[]":
                    autocast_only(trainer)
                    result[f"{name}, autocast only"] = score(trainer, played)
            lines.append(result)
            print(json.dumps(result), flush=True)
    finally:
        engine.shutdown()
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    ways = [k for k in lines[0] if k not in ("sft_steps", "engine")]
    print(f"{'sft steps':>9} " + " ".join(f"{w:>26}" for w in ways) + "   (mean |trainer - engine| logprob)")
    for r in lines:
        print(f"{r['sft_steps']:9d} " + " ".join(f"{r[w]:26.3e}" for w in ways))
    for way in ways[1:]:
        ratios = [r[way] / max(r["lora"], 1e-12) for r in lines]
        print(f"{way} / lora, median of {len(ratios)}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
