"""The phases of a step as the driver runs them: rollouts (with dynamic sampling's refill rounds), the LoRA
sync, and the small metric helpers that merge what the actors report.

Each function takes the `Actors` of app/driver/cluster.py and returns refs or small dicts: trajectories and
adapters stay in the object store.
"""

from __future__ import annotations

import contextlib
import time

import ray

from app.config import Config, TrainConfig
from app.driver.cluster import Actors
from app.learning.grpo import informative_groups
from app.rollout.engines import Sampling


@contextlib.contextmanager
def timed(times: dict, phase: str):
    start = time.perf_counter()
    yield
    times[f"time_{phase}_s"] = time.perf_counter() - start


def rollout_phase(actors: Actors, mazes, cfg: Config, step: int, round_: int = 0):
    """Each rollout actor plays whole maze groups; returns (summaries, trajectory refs).

    Round r of a step numbers its groups from r x len(mazes), so groups of different rounds never merge."""

    seed = cfg.train.seed * 1_000_003 + step * 7_919 + round_ * 104_729
    shares = [[] for _ in actors.rollouts]
    for group, maze in enumerate(mazes, start=round_ * len(mazes)):
        shares[group % len(shares)].append((maze, group))  # the maze itself: its start may not be the seed's
    # each actor its own seeds: an engine seeds request i with seed + i, so actors sharing one would draw the same
    # random numbers for their i-th runs (the offset is past any one actor's requests x turns)
    refs = [
        a.play.remote(
            share,
            cfg.rollout.n_samples_per_prompt,
            Sampling(
                cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, seed=seed + k * 15_485_863
            ),
        )
        for k, (a, share) in enumerate(zip(actors.rollouts, shares))
        if share
    ]
    summaries = ray.get([s for s, _ in refs])
    return summaries, [t for _, t in refs]


def sampling_phase(play_round, sampler, train: TrainConfig):
    """The step's rollouts: train.mazes_per_step fresh mazes, then, while fewer than train.min_informative_groups
    of the step's groups earned differing rewards, another round of fresh mazes (at most train.refill_rounds).

    DAPO's dynamic sampling: once a policy solves or fails most mazes in all of its runs, most groups carry no
    GRPO signal (11-15 of 16 in an 8B-scale GPU run), and more mazes is how a step gets back to a batch that
    does. `play_round(mazes, round_)` plays one round (rollout_phase); returns (summaries, trajectory refs,
    {rollout_rounds, rollout_informative_groups})."""
    summaries, refs = play_round(sampler.next(train.mazes_per_step), 0)
    rounds = 1
    while informative_groups(summaries) < train.min_informative_groups and rounds <= train.refill_rounds:
        more, more_refs = play_round(sampler.next(train.mazes_per_step), rounds)
        summaries, refs, rounds = summaries + more, refs + more_refs, rounds + 1
    return summaries, refs, {"rollout_rounds": rounds, "rollout_informative_groups": informative_groups(summaries)}


def sync_lora(actors: Actors, lora_ref, version: int) -> None:
    """Every rollout actor loads rank 0's adapter from the object store (no file), then wakes."""

    ray.get([a.load_lora.remote(lora_ref, version) for a in actors.rollouts])
    ray.get([a.wake.remote() for a in actors.rollouts])


def merge_rollout(summaries: list[dict], seconds: float) -> dict:
    n = sum(s["episodes"] for s in summaries) or 1
    out = {
        f"rollout_{k}": sum(s[k] * s["episodes"] for s in summaries) / n
        for k in (
            "reward_mean",
            "solve_rate",
            "turns_mean",
            "invalid_action_rate",
            "truncated_reply_rate",
            "context_tokens_mean",
        )
    }
    tokens = sum(s["generated_tokens"] for s in summaries)
    out.update(
        rollout_episodes=n, rollout_generated_tokens=tokens, rollout_generated_tokens_per_s=tokens / max(seconds, 1e-9)
    )
    return out


def prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
