"""What the driver loop needs around it: Ray connection, the actors' lifecycle, and the phase helpers.

Kept apart from app/main.py so the loop there reads in one screen.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from app.config import Config, TrainConfig
from placement import plan as placement


@dataclass
class Actors:
    pg: object
    rollouts: list
    trainers: list
    evaluator: object
    consolidator: object


def absolute_paths(cfg: Config) -> Config:
    """Actors run in other working directories: every path they see must be absolute."""
    run_dir = Path(cfg.output_dir).resolve() / cfg.run_name
    ck = cfg.checkpoint
    ck = replace(ck, ckpt_path=str(Path(ck.ckpt_path).resolve()) if ck.ckpt_path else str(run_dir / "checkpoints"),
                 export_dir=str(Path(ck.export_dir).resolve()) if ck.export_dir else str(run_dir / "export"),
                 resume_path=(ck.resume_path if not ck.resume_path or ck.resume_path.startswith("s3://")
                              else str(Path(ck.resume_path).resolve())))
    model = cfg.model
    if model.path != "tiny":
        model = replace(model, path=str(Path(model.path).resolve()))
    if model.adapter_init:
        model = replace(model, adapter_init=str(Path(model.adapter_init).resolve()))
    return replace(cfg, output_dir=str(Path(cfg.output_dir).resolve()), checkpoint=ck, model=model)


def connect_ray(cfg: Config):
    import ray

    if ray.is_initialized():  # already connected (tests, notebooks)
        return ray
    address = cfg.placement.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:  # a private local cluster: no token auth to set up
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, namespace=f"mazerl-{cfg.run_name}", log_to_driver=True,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    return ray


def recoverable_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean an actor, its node or its objects are gone (the run itself is sound)."""
    from ray import exceptions as rex

    return (rex.RayActorError, rex.ActorUnavailableError, rex.NodeDiedError, rex.WorkerCrashedError,
            rex.ObjectLostError, rex.OwnerDiedError, rex.ActorPlacementGroupRemoved, TimeoutError)


def model_cache(cfg: Config) -> str:
    return str(Path(cfg.output_dir) / ".models")


def adapter_spec(cfg: Config):
    from transformers import AutoConfig

    from app.adapters import AdapterSpec
    from app.model import ensure_model

    config = AutoConfig.from_pretrained(str(ensure_model(cfg.model, model_cache(cfg))))
    return AdapterSpec.for_model(config.text_config, cfg.lora)


def spawn(cfg: Config, plan: placement.Plan) -> Actors:
    """The placement group and every named actor, ready (trainer ranks joined, engines started)."""
    import ray

    from actors.consolidator import ConsolidatorActor
    from actors.evaluator import EvaluatorActor
    from actors.rollout import RolloutActor
    from actors.trainer import TrainerActor

    cache = model_cache(cfg)
    spec = adapter_spec(cfg)
    pg = placement.create_placement_group(plan, cfg.placement.wait_for_resources_s, name=f"mazerl-{cfg.run_name}")
    n = plan.num_pairs
    rollouts = [RolloutActor.options(name=f"rollout-{i}", **placement.rollout_options(plan, pg, i))
                .remote(cfg, i, cache) for i in range(plan.num_rollouts)]
    trainers = [TrainerActor.options(name=f"trainer-{r}", **placement.trainer_options(plan, pg, r))
                .remote(cfg, r, n, cache) for r in range(n)]
    evaluator = EvaluatorActor.options(name="evaluator", **placement.evaluator_options(plan)).remote(
        cfg, rollouts, str(Path(cfg.output_dir) / cfg.run_name / "eval"))
    consolidator = ConsolidatorActor.options(
        name="consolidator", **placement.consolidator_options(plan, ray.cluster_resources())).remote(cfg, spec)
    actors = Actors(pg, rollouts, trainers, evaluator, consolidator)
    try:
        addr, port = ray.get(trainers[0].rendezvous_address.remote())
        ray.get([t.setup.remote(addr, port) for t in trainers] + [r.ready.remote() for r in rollouts]
                + [consolidator.node_id.remote()])
    except BaseException:
        shutdown(actors)
        raise
    return actors


def shutdown(actors: Actors) -> None:
    import ray

    for a in actors.rollouts + actors.trainers + [actors.evaluator, actors.consolidator]:
        with contextlib.suppress(Exception):
            ray.kill(a)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(actors.pg)


@contextlib.contextmanager
def timed(times: dict, phase: str):
    start = time.perf_counter()
    yield
    times[f"time_{phase}_s"] = time.perf_counter() - start


def rollout_phase(actors: Actors, mazes, cfg: Config, step: int, round_: int = 0):
    """Each rollout actor plays whole maze groups; returns (summaries, trajectory refs).

    Round r of a step numbers its groups from r x len(mazes), so groups of different rounds never merge."""
    import ray

    from app.engines import Sampling

    seed = cfg.train.seed * 1_000_003 + step * 7_919 + round_ * 104_729
    shares = [[] for _ in actors.rollouts]
    for group, maze in enumerate(mazes, start=round_ * len(mazes)):
        shares[group % len(shares)].append((maze, group))  # the maze itself: its start may not be the seed's
    # each actor its own seeds: an engine seeds request i with seed + i, so actors sharing one would draw the same
    # random numbers for their i-th runs (the offset is past any one actor's requests x turns)
    refs = [a.play.remote(share, cfg.rollout.n_samples_per_prompt,
                          Sampling(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p,
                                   seed=seed + k * 15_485_863))
            for k, (a, share) in enumerate(zip(actors.rollouts, shares)) if share]
    summaries = ray.get([s for s, _ in refs])
    return summaries, [t for _, t in refs]


def sampling_phase(play_round, sampler, train: TrainConfig):
    """The step's rollouts: train.mazes_per_step fresh mazes, then, while fewer than train.min_informative_groups
    of the step's groups earned differing rewards, another round of fresh mazes (at most train.refill_rounds).

    DAPO's dynamic sampling: once a policy solves or fails most mazes in all of its runs, most groups carry no
    GRPO signal (docs/RESULTS.md, twelfth attempt: 11-15 of 16), and more mazes is how a step gets back to a batch
    that does. `play_round(mazes, round_)` plays one round (rollout_phase); returns (summaries, trajectory refs,
    {rollout_rounds, rollout_informative_groups})."""
    from app.grpo import informative_groups

    summaries, refs = play_round(sampler.next(train.mazes_per_step), 0)
    rounds = 1
    while informative_groups(summaries) < train.min_informative_groups and rounds <= train.refill_rounds:
        more, more_refs = play_round(sampler.next(train.mazes_per_step), rounds)
        summaries, refs, rounds = summaries + more, refs + more_refs, rounds + 1
    return summaries, refs, {"rollout_rounds": rounds, "rollout_informative_groups": informative_groups(summaries)}


def sync_lora(actors: Actors, lora_ref, version: int) -> None:
    """Every rollout actor loads rank 0's adapter from the object store (no file), then wakes."""
    import ray

    ray.get([a.load_lora.remote(lora_ref, version) for a in actors.rollouts])
    ray.get([a.wake.remote() for a in actors.rollouts])


def merge_rollout(summaries: list[dict], seconds: float) -> dict:
    n = sum(s["episodes"] for s in summaries) or 1
    out = {f"rollout_{k}": sum(s[k] * s["episodes"] for s in summaries) / n
           for k in ("reward_mean", "solve_rate", "turns_mean", "invalid_action_rate", "truncated_reply_rate",
                     "context_tokens_mean")}
    tokens = sum(s["generated_tokens"] for s in summaries)
    out.update(rollout_episodes=n, rollout_generated_tokens=tokens,
               rollout_generated_tokens_per_s=tokens / max(seconds, 1e-9))
    return out


def prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
