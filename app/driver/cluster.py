"""The cluster's side of a run: the Ray connection, the named actors' lifecycle, and which errors mean one was lost.

`spawn` makes the placement group and every actor and waits until they are ready; `shutdown` releases them all;
`recoverable_errors` are what the driver loop (app/main.py) answers with a recovery instead of a crash.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import exceptions as rex
from transformers import AutoConfig

from actors.consolidator import ConsolidatorActor
from actors.evaluator import EvaluatorActor
from actors.rollout import RolloutActor
from actors.trainer import TrainerActor
from app.config import Config
from app.model.adapters import AdapterSpec
from app.model.build import ensure_model
from placement import plan as placement


@dataclass
class Actors:
    pg: object
    rollouts: list
    trainers: list
    evaluator: object
    consolidator: object


def connect_ray(cfg: Config):

    if ray.is_initialized():  # already connected (tests, notebooks)
        return ray
    address = cfg.placement.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:  # a private local cluster: no token auth to set up
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address=address,
        namespace=f"mazerl-{cfg.run_name}",
        log_to_driver=True,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    return ray


def recoverable_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean an actor, its node or its objects are gone (the run itself is sound)."""

    return (
        rex.RayActorError,
        rex.ActorUnavailableError,
        rex.NodeDiedError,
        rex.WorkerCrashedError,
        rex.ObjectLostError,
        rex.OwnerDiedError,
        rex.ActorPlacementGroupRemoved,
        TimeoutError,
    )


def model_cache(cfg: Config) -> str:
    return str(Path(cfg.output_dir) / ".models")


def adapter_spec(cfg: Config):

    config = AutoConfig.from_pretrained(str(ensure_model(cfg.model, model_cache(cfg))))
    return AdapterSpec.for_model(config.text_config, cfg.lora)


def spawn(cfg: Config, plan: placement.Plan) -> Actors:
    """The placement group and every named actor, ready (trainer ranks joined, engines started)."""

    cache = model_cache(cfg)
    spec = adapter_spec(cfg)
    pg = placement.create_placement_group(plan, cfg.placement.wait_for_resources_s, name=f"mazerl-{cfg.run_name}")
    n = plan.num_pairs
    rollouts = [
        RolloutActor.options(name=f"rollout-{i}", **placement.rollout_options(plan, pg, i)).remote(cfg, i, cache)
        for i in range(plan.num_rollouts)
    ]
    trainers = [
        TrainerActor.options(name=f"trainer-{r}", **placement.trainer_options(plan, pg, r)).remote(cfg, r, n, cache)
        for r in range(n)
    ]
    evaluator = EvaluatorActor.options(name="evaluator", **placement.evaluator_options(plan)).remote(
        cfg, rollouts, str(Path(cfg.output_dir) / cfg.run_name / "eval")
    )
    consolidator = ConsolidatorActor.options(
        name="consolidator", **placement.consolidator_options(plan, ray.cluster_resources())
    ).remote(cfg, spec)
    actors = Actors(pg, rollouts, trainers, evaluator, consolidator)
    try:
        addr, port = ray.get(trainers[0].rendezvous_address.remote())
        ray.get(
            [t.setup.remote(addr, port) for t in trainers]
            + [r.ready.remote() for r in rollouts]
            + [consolidator.node_id.remote()]
        )
    except BaseException:
        shutdown(actors)
        raise
    return actors


def shutdown(actors: Actors) -> None:

    for a in actors.rollouts + actors.trainers + [actors.evaluator, actors.consolidator]:
        with contextlib.suppress(Exception):
            ray.kill(a)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(actors.pg)
