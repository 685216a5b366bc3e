"""How far one GRPO update moves the policy, per learning rate: one rollout batch, several rates side by side.

The seventh GPU attempt (docs/journal/) asked whether GRPO's greedy solve rate stood still because each
LoRA update barely moved the policy. This plays one step's batch (train.mazes_per_step training mazes x
rollout.n_samples_per_prompt samples at the rollout temperature, on the HF engine: no vLLM needed), then
for each --lrs rate trains a fresh adapter on that same batch with train.update_epochs passes and reports
the last pass's k3 KL to the pre-update policy (train_update_kl) and its clipped share, then, after the
whole update, the k3 KL on the batch's sampled tokens and the share of them whose probability moved by
more than 10%.

    python scripts/lab/update_size.py CONFIG MODEL_DIR OUT.jsonl [key=value ...] --lrs 2e-4 1e-3 --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.config import ConfigError, load_config  # noqa: E402


def sampled_logprobs(trainer, items) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprob of every sampled reply token of the batch under the trainer's current policy, and its mask."""
    from app.learning.batch import micro_batches

    logps, masks = [], []
    batches = micro_batches(items, items, trainer.cfg.train.micro_batch)
    for i in range(batches.real):
        logp, _, mask, _ = trainer.token_logprobs(batches.get(i)[0], with_grad=False)
        logps.append(logp.flatten().cpu())
        masks.append(mask.flatten().cpu())
    return torch.cat(logps), torch.cat(masks)


def measure(
    config: str, overrides: list[str], model_dir: str, trajectories, lrs: list[float], device: str, out: Path
) -> list[dict]:
    """One update per rate, each from a fresh adapter (the same seed) on the same batch; rows also go to `out`."""
    from app.learning.batch import build_items
    from app.learning.grpo import compute_advantages
    from app.learning.training import PolicyTrainer

    rows = []
    with out.open("w") as log:
        for lr in lrs:
            cfg = load_config(config, [*overrides, f"train.lr={lr}"])
            trainer = PolicyTrainer(cfg, model_dir, device=device)
            keep = compute_advantages(
                [t.group for t in trajectories], [t.reward for t in trajectories], cfg.train.advantage, False
            )
            items = build_items(trajectories, keep)
            before, mask = sampled_logprobs(trainer, items)
            metrics = trainer.train_step(trajectories)
            after, _ = sampled_logprobs(trainer, items)
            delta = (after - before)[mask > 0]
            row = {
                "lr": lr,
                "update_epochs": cfg.train.update_epochs,
                "update_kl": metrics["update_kl"],
                "clip_fraction": metrics["clip_fraction"],
                # k3 KL(before || after) on tokens sampled from before
                "step_kl": (torch.exp(delta) - delta - 1).mean().item(),
                "moved_10pct": (delta.abs() > math.log(1.1)).float().mean().item(),
                "grad_norm": metrics["grad_norm"],
                "zero_variance_groups": metrics["zero_variance_groups"],
                "groups": metrics["groups"],
                "train_step_s": metrics["train_step_s"],
            }
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            del trainer
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("model_dir", help="the full model GRPO starts from (an SFT checkpoint folder)")
    ap.add_argument("out", type=Path)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--lrs", type=float, nargs="+", default=[2e-4, 1e-3])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    try:
        cfg = load_config(args.config, [*args.overrides, f"model.path={args.model_dir}"])
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.hf import HFEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.rollout.trajectory import summarize
    from app.world.rules import EpisodeSettings
    from app.world.sampler import MazeSampler, eval_mazes

    torch.manual_seed(cfg.train.seed)
    t0 = time.perf_counter()
    engine = HFEngine(args.model_dir, cfg.lora, dtype=cfg.model.dtype, device=args.device)
    held_out = {m.identity for m in eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)}
    mazes = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, held_out).next(cfg.train.mazes_per_step)
    n = cfg.rollout.n_samples_per_prompt
    requests = [EpisodeRequest(m, group, s) for group, m in enumerate(mazes) for s in range(n)]
    sampling = Sampling(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, seed=cfg.train.seed)
    trajectories = play_episodes(engine, engine.codec, requests, EpisodeSettings.from_config(cfg), sampling)
    del engine
    rollout = summarize(trajectories)
    print(
        f"batch: {len(trajectories)} episodes, solve rate {rollout['solve_rate']:.3f} "
        f"[{time.perf_counter() - t0:.0f}s]",
        flush=True,
    )
    rows = measure(
        args.config,
        [*args.overrides, f"model.path={args.model_dir}"],
        args.model_dir,
        trajectories,
        args.lrs,
        args.device,
        args.out,
    )
    print(f"\n=== one GRPO update on one batch ({cfg.train.update_epochs} passes) ===")
    print(f"{'lr':>8} {'last-pass kl':>13} {'clipped':>8} {'step kl':>9} {'moved >10%':>11} {'grad norm':>10}")
    for r in rows:
        print(
            f"{r['lr']:>8.1e} {r['update_kl']:>13.2e} {r['clip_fraction']:>8.4f} {r['step_kl']:>9.2e} "
            f"{r['moved_10pct']:>11.4f} {r['grad_norm']:>10.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
