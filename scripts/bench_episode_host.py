"""The episode loop's own host time, with an engine that answers at once: rendering, pictures, segments, parsing.

A GPU rollout is host-bound (docs/BENCHMARKS.md, twelfth run), so this is the part of it the project's code owns.
Every reply is a valid random move, so runs last the whole turn budget.

    python scripts/bench_episode_host.py [--config configs/learn_h200.yaml] [--mazes 16] [--repeats 3]

To compare two versions, run it in each tree (e.g. `git worktree add /tmp/old HEAD~1`) with PYTHONPATH set to it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from app.engines.base import Engine, Generation


class InstantEngine(Engine):
    """Replies with a random move at once: only the loop's own work is timed."""

    def __init__(self, codec, seed: int = 0):
        self.rng, self.lora_version = random.Random(seed), 0
        self.replies = [codec.tokenizer.encode(f"('move', {d})", add_special_tokens=False) + [codec.im_end_id]
                        for d in range(4)]

    def generate(self, prompts, sampling):
        return [Generation(ids, [0.0] * len(ids), "stop") for ids in (self.rng.choice(self.replies) for _ in prompts)]

    def load_lora(self, tensors, version):
        self.lora_version = version

    def lora_state(self):
        return None

    def stats(self):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/learn_h200.yaml")
    ap.add_argument("--mazes", type=int, default=16, help="groups, each played rollout.n_samples_per_prompt times")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="/tmp/mazerl-bench-models")
    args = ap.parse_args()

    from app.config import load_config
    from app.encoding import ChatCodec
    from app.engines.base import Sampling
    from app.episodes import EpisodeRequest, episode_settings, play_episodes
    from app.maze import generate_maze
    from app.model import ensure_model, load_processor

    cfg = load_config(args.config)
    codec = ChatCodec(load_processor(ensure_model(cfg.model, args.cache)))
    settings = episode_settings(cfg)
    n = cfg.rollout.n_samples_per_prompt
    requests = [EpisodeRequest(generate_maze(1000 + g, cfg.maze.size), g, s) for g in range(args.mazes) for s in range(n)]
    seconds, turns = [], 0
    for repeat in range(args.repeats):
        start = time.perf_counter()
        runs = play_episodes(InstantEngine(codec, repeat), codec, requests, settings, Sampling(cfg.rollout.max_new_tokens))
        seconds.append(time.perf_counter() - start)
        turns = sum(t.turns for t in runs)
    print(f"{len(requests)} runs, {turns} turns: median {statistics.median(seconds):.3f} s "
          f"({1e3 * statistics.median(seconds) / max(turns, 1):.3f} ms a turn) over {args.repeats}")


if __name__ == "__main__":
    main()
