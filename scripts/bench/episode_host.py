"""The episode loop's own host time, with an engine that answers at once: rendering, pictures, segments, parsing.

A GPU rollout is host-bound (a py-spy profile, docs/BENCHMARKS.md), so this is the part of it the project's code owns.
Every reply is a valid random move, so runs last the whole turn budget.

    python scripts/bench/episode_host.py [--config scripts/lab/configs/learn_h200.yaml] [--mazes 16] [--repeats 3]

To compare two versions, run it in each tree (e.g. `git worktree add /tmp/old HEAD~1`) with PYTHONPATH set to it.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="scripts/lab/configs/learn_h200.yaml")
    ap.add_argument("--mazes", type=int, default=16, help="groups, each played rollout.n_samples_per_prompt times")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="/tmp/mazerl-bench-models")
    args = ap.parse_args()

    from app.config import load_config
    from app.model.build import ensure_model
    from app.model.load import load_processor
    from app.rollout.encoding import ChatCodec
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.scripted import MOVES, ScriptedEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    cfg = load_config(args.config)
    codec = ChatCodec(load_processor(ensure_model(cfg.model, args.cache)))
    settings = EpisodeSettings.from_config(cfg)
    n = cfg.rollout.n_samples_per_prompt
    requests = [
        EpisodeRequest(generate_maze(1000 + g, cfg.maze.size), g, s) for g in range(args.mazes) for s in range(n)
    ]
    seconds, turns = [], 0
    for repeat in range(args.repeats):
        start = time.perf_counter()
        runs = play_episodes(
            ScriptedEngine(codec, MOVES, cut_share=0.0, seed=repeat, record=False),
            codec,
            requests,
            settings,
            Sampling(cfg.rollout.max_new_tokens),
        )
        seconds.append(time.perf_counter() - start)
        turns = sum(t.turns for t in runs)
    print(
        f"{len(requests)} runs, {turns} turns: median {statistics.median(seconds):.3f} s "
        f"({1e3 * statistics.median(seconds) / max(turns, 1):.3f} ms a turn) over {args.repeats}"
    )


if __name__ == "__main__":
    main()
