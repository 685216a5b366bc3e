"""The phases of a step as the driver runs them: rollouts (with dynamic sampling's refill rounds), the LoRA
sync, and the small metric helpers that merge what the actors report.

Each function takes the `Actors` of app/driver/cluster.py and returns refs or small dicts: trajectories and
adapters stay in the object store.
"""

from __future__ import annotations

import contextlib
import logging
import time

from app.config import Config, TrainConfig
from app.driver.cluster import Actors
from app.driver.waits import Waits, fetch_failed_returns
from app.learning.grpo import informative_groups, uninformative_groups
from app.rollout.engines import Sampling
from app.rollout.engines.base import derive_seed

log = logging.getLogger("mazerl")


@contextlib.contextmanager
def timed(times: dict, phase: str):
    start = time.perf_counter()
    yield
    times[f"time_{phase}_s"] = time.perf_counter() - start


def rollout_seed(train_seed: int, step: int, round_: int, actor: int) -> int:
    """The seed rollout actor `actor` samples round `round_` of `step` with: every (step, round, actor, turn,
    request) of a run draws from its own seed (app.rollout.engines.base.derive_seed)."""
    return derive_seed(train_seed, step, round_, actor)


def rollout_phase(actors: Actors, mazes, cfg: Config, step: int, round_: int, waits: Waits):
    """Each rollout actor plays whole maze groups; returns (summaries, trajectory refs).

    Round r of a step numbers its groups from r x len(mazes), so groups of different rounds never merge."""
    shares = [[] for _ in actors.rollouts]
    for group, maze in enumerate(mazes, start=round_ * len(mazes)):
        shares[group % len(shares)].append((maze, group))  # the maze itself: its start may not be the seed's
    r = cfg.rollout
    playing = [k for k, share in enumerate(shares) if share]
    refs = [
        actors.rollouts[k].play.remote(
            shares[k],
            r.n_samples_per_prompt,
            Sampling(r.max_new_tokens, r.temperature, r.top_p, seed=rollout_seed(cfg.train.seed, step, round_, k)),
        )
        for k in playing
    ]
    try:
        summaries = waits.gather([s for s, _ in refs], "rollout", [actors.rollout_names[k] for k in playing])
    except BaseException:
        fetch_failed_returns(refs)
        raise
    return summaries, [t for _, t in refs]


def sampling_phase(play_round, sampler, train: TrainConfig):
    """The step's rollouts: train.mazes_per_step fresh mazes, then, while fewer than train.min_informative_groups
    of the step's groups earned differing rewards, another round of fresh mazes (at most train.refill_rounds).

    DAPO's dynamic sampling: once a policy solves or fails most mazes in all of its runs, most groups carry no
    GRPO signal (11-15 of 16 in an 8B-scale GPU run), and more mazes is how a step gets back to a batch that
    does. `play_round(mazes, round_)` plays one round (rollout_phase); returns (summaries, trajectory refs,
    {rollout_rounds, rollout_informative_groups, rollout_groups_all_solved, rollout_groups_none_solved})."""
    summaries, refs = play_round(sampler.next(train.mazes_per_step), 0)
    rounds = 1
    while informative_groups(summaries) < train.min_informative_groups and rounds <= train.refill_rounds:
        more, more_refs = play_round(sampler.next(train.mazes_per_step), rounds)
        summaries, refs, rounds = summaries + more, refs + more_refs, rounds + 1
    counts = {"rollout_rounds": rounds, "rollout_informative_groups": informative_groups(summaries)}
    return summaries, refs, counts | uninformative_groups(summaries)


def sync_lora(actors: Actors, lora_ref, version: int, waits: Waits) -> None:
    """Every rollout actor loads rank 0's adapter from the object store (no file), then wakes."""
    names = actors.rollout_names
    waits.gather([a.load_lora.remote(lora_ref, version) for a in actors.rollouts], "sync", names)
    waits.gather([a.wake.remote() for a in actors.rollouts], "sync", names)


def sleep_engines(actors: Actors, waits: Waits) -> None:
    """The engines free their KV cache (and on a GPU their weights) so the colocated trainer has the memory."""
    waits.gather([a.sleep.remote() for a in actors.rollouts], "sleep", actors.rollout_names)


def train_phase(actors: Actors, trajectory_refs: list, step: int, waits: Waits, meanwhile=None):
    """One GRPO update on every trainer rank, the driver running `meanwhile()` while the ranks train; returns
    (rank 0's metrics, a ref of rank 0's new adapter, what `meanwhile` returned or None)."""
    results = [t.step.remote(trajectory_refs, step) for t in actors.trainers]
    during = meanwhile() if meanwhile is not None else None
    try:
        metrics = waits.gather([m for m, _ in results], "train", actors.trainer_names)[0]
    except BaseException:
        fetch_failed_returns(results)
        raise
    return metrics, results[0][1], during


def warm_start_step(actors: Actors, seeds: list[int], lr: float, waits: Waits) -> dict:
    """One supervised warm-start step on these training mazes, on every rank; rank 0's metrics."""
    done = waits.gather([t.sft_step.remote(seeds, lr) for t in actors.trainers], "sft", actors.trainer_names)
    return done[0]


def validate(actors: Actors, mazes: list, waits: Waits) -> dict:
    """The greedy play's summary on these training mazes (the warm start's validation set)."""
    ref = actors.evaluator.validate.remote(mazes, actors.rollouts)
    return waits.one(ref, "eval", actors.label("evaluator"))


def evaluate(actors: Actors, step: int, waits: Waits) -> dict:
    """The held-out mazes played greedily through the rollout actors; the evaluator's summary, `eval_` prefixed."""
    ref = actors.evaluator.evaluate.remote(step, actors.rollouts)
    return prefixed("eval", waits.one(ref, "eval", actors.label("evaluator")))


def export_adapter(actors: Actors, step: int, lora_ref, waits: Waits) -> dict:
    ref = actors.consolidator.export_adapter.remote(step, lora_ref)
    return waits.one(ref, "checkpoint", actors.label("consolidator"))


def write_checkpoint(actors: Actors, step: int, json_state, waits: Waits) -> dict:
    """The full training state (rank 0's adapter, optimizer, RNG and json_state(trainer state)), committed by the
    consolidator; returns its report."""
    calls = [t.checkpoint_state.remote() for t in actors.trainers]
    adapter, optimizer, rng, trainer_state = zip(*calls)
    try:
        trainer_json = waits.gather(trainer_state, "checkpoint", actors.trainer_names)[0]
    except BaseException:
        fetch_failed_returns([(state, *others) for *others, state in calls])
        raise
    ref = actors.consolidator.save_checkpoint.remote(step, adapter[0], optimizer[0], rng[0], json_state(trainer_json))
    return waits.one(ref, "checkpoint", actors.label("consolidator"))


def flush_replicas(actors: Actors, waits: Waits) -> dict:
    """At the end of a run: the S3 copies of its checkpoints and exports made (bounded by waits.phase_s)."""
    bound = waits.cfg.phase_s
    status = waits.one(actors.consolidator.flush.remote(bound), "checkpoint", actors.label("consolidator"), bound + 60)
    if status["replica_pending"]:
        log.warning(
            "%d S3 copies not made after %.0f s (%s); the shared directory holds every checkpoint, and the next "
            "run's consolidator makes the newest copy first",
            status["replica_pending"],
            bound,
            status["replica_last_error"],
        )
    return status


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
            "context_full_rate",
            "context_tokens_mean",
        )
    }
    # the oldest adapter any of the batch's episodes was played by (the engines all hold one version)
    out["rollout_lora_version"] = min(s["lora_version"] for s in summaries) if summaries else -1
    out.update(
        rollout_context_tokens=sum(s.get("context_tokens", 0.0) for s in summaries),
        rollout_images=sum(s.get("images", 0.0) for s in summaries),
    )
    tokens = sum(s["generated_tokens"] for s in summaries)
    out.update(
        rollout_episodes=n, rollout_generated_tokens=tokens, rollout_generated_tokens_per_s=tokens / max(seconds, 1e-9)
    )
    return out


def prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
