"""A GRPO training step with and without the vision cache (app/learning/speedups/vision_cache.py), side by side.

Two trainers of the same model train on the same trajectories, alternating, each repeat on fresh mazes (so the
cached trainer pays for its new pictures every step, as a run does when its mazes are new). The trajectories are the
solver's demonstrations with random moves mixed in (`app.learning.sft.demonstration`, noise 0.3), n runs a maze,
with random 0/1 rewards so every group trains. Settings as in the fourteenth learning run: 2 passes, the trust
region, step advantages off (random rewards make no anchor states).

    python scripts/bench/train_step.py [--config scripts/lab/configs/learn_h200.yaml] [--mazes 2] [--repeats 3] \
        [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="scripts/lab/configs/learn_h200.yaml")
    ap.add_argument("--mazes", type=int, default=2, help="groups a step, each of rollout.n_samples_per_prompt runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache", default="/tmp/mazerl-bench-models")
    args = ap.parse_args()

    import torch

    from app.config import load_config
    from app.learning.sft import demonstration
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    common = [
        "train.update_epochs=2",
        "train.max_update_kl=0.03",
        "train.drop_zero_variance_groups=true",
        "train.picture_cache_gb=1",
    ]
    if args.device == "cpu":
        common += ["model.dtype=float32", "rollout.engine=hf"]
    cfg_plain = load_config(args.config, common + ["train.vision_cache_gb=0"])
    cfg_cached = load_config(args.config, common + ["train.vision_cache_gb=1"])
    model_dir = str(ensure_model(cfg_plain.model, args.cache))
    trainers = {
        "recomputed": PolicyTrainer(cfg_plain, model_dir, device=args.device),
        "cached": PolicyTrainer(cfg_cached, model_dir, device=args.device),
    }
    settings = EpisodeSettings.from_config(cfg_plain)
    n = cfg_plain.rollout.n_samples_per_prompt
    rng = random.Random(0)
    seconds = {name: [] for name in trainers}
    for repeat in range(args.repeats):
        trajectories = []
        for group in range(args.mazes):
            maze = generate_maze(10_000 + repeat * args.mazes + group, cfg_plain.maze.size)
            for sample in range(n):
                t = demonstration(maze, trainers["cached"].codec, settings, group=group, noise=0.3, seed=sample)
                t.sample, t.reward = sample, float(rng.random() < 0.5)
                trajectories.append(t)
        order = list(trainers) if repeat % 2 == 0 else list(reversed(trainers))
        for name in order:
            if args.device != "cpu":
                torch.cuda.synchronize()
            stats = trainers[name].train_step(trajectories)
            seconds[name].append(stats["train_step_s"])
        pictures = sum(len(t.images) for t in trajectories)
        print(
            f"repeat {repeat}: {len(trajectories)} runs, {pictures} pictures "
            f"({len({p for t in trajectories for p in t.images})} distinct), "
            + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in trainers)
        )
    cache = trainers["cached"].vision_cache
    plain, cached = statistics.median(seconds["recomputed"]), statistics.median(seconds["cached"])
    print(f"vision cache: {cache.hits} hits, {cache.misses} misses, {cache.bytes / 2**20:.1f} MiB")
    print(f"train_step median: recomputed {plain:.2f} s, cached {cached:.2f} s, cached/recomputed {cached / plain:.3f}")


if __name__ == "__main__":
    main()
