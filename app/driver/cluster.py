"""The cluster's side of a run: the Ray connection, the named actors' lifecycle, and which errors mean one was lost.

`spawn` makes the placement group and every actor and waits until they are ready; `shutdown` releases them all;
`recoverable_errors` are what the driver loop (app/main.py) answers with a recovery instead of a crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray import exceptions as rex
from transformers import AutoConfig

from actors.consolidator import ConsolidatorActor
from actors.evaluator import EvaluatorActor
from actors.rollout import RolloutActor
from actors.trainer import TrainerActor
from app.config import Config
from app.driver.preflight import model_cache
from app.driver.waits import LOST, Waits
from app.model.adapters import AdapterSpec
from app.model.build import ensure_model
from placement import plan as placement

log = logging.getLogger("mazerl")


@dataclass
class Actors:
    pg: object
    rollouts: list
    trainers: list
    evaluator: object
    consolidator: object
    nodes: dict = field(default_factory=dict)  # actor name -> the node it runs on
    device_name: str = "cpu"  # the trainers' device (its peak FLOP/s is the utilisation's denominator)

    def label(self, name: str) -> str:
        """How a wait names an actor: with its node, so that a stall says where to look."""
        node = self.nodes.get(name)
        return f"{name} (node {node[:8]})" if node else name

    @property
    def trainer_names(self) -> list[str]:
        return [self.label(f"trainer-{r}") for r in range(len(self.trainers))]

    @property
    def rollout_names(self) -> list[str]:
        return [self.label(f"rollout-{i}") for i in range(len(self.rollouts))]


def connect_ray(cfg: Config):

    if ray.is_initialized():  # already connected (tests, notebooks)
        return ray
    address = cfg.placement.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:  # a private local cluster: no token auth to set up
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # "local", not None: with None, ray.init joins the cluster named in /tmp/ray/ray_current_cluster, and when
        # that cluster is gone (a crashed or killed earlier one) it waits on its address without a word
        address = "local"
    ray.init(
        address=address,
        namespace=f"mazerl-{cfg.run_name}",
        log_to_driver=True,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    return ray


def ray_dashboard() -> str | None:
    """The address `ray job submit` takes for this cluster (its dashboard), where Ray knows it."""
    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:  # noqa: BLE001 - only a hint for the run's summary
        return None
    return url if not url or url.startswith("http") else f"http://{url}"


def recoverable_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean an actor, its node or its objects are gone (the run itself is sound)."""

    return (*LOST, rex.ObjectLostError, TimeoutError)


def adapter_spec(cfg: Config):

    config = AutoConfig.from_pretrained(str(ensure_model(cfg.model, model_cache(cfg))))
    return AdapterSpec.for_model(config.text_config, cfg.lora, config.vision_config)


def spawn(cfg: Config, plan: placement.Plan, waits: Waits) -> Actors:
    """The placement group and every named actor, ready (trainer ranks joined, engines started), each wait bounded.

    The head's actors come first: they take their share of the head before the placement group can (PACK would
    otherwise fill a CPU-only head with a bundle and leave the consolidator nowhere to go), so the cluster holds
    what `--plan --cluster` prints."""
    cache, spec = model_cache(cfg), adapter_spec(cfg)
    resources = ray.cluster_resources()
    placement.check_nodes(plan, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    bound = cfg.waits.actor_start_s
    consolidator = ConsolidatorActor.options(
        name="consolidator", **placement.consolidator_options(plan, resources)
    ).remote(cfg, spec)
    evaluator = EvaluatorActor.options(name="evaluator", **placement.evaluator_options(plan, resources)).remote(
        cfg, str(Path(cfg.output_dir) / cfg.run_name / "eval")
    )
    actors = Actors(None, [], [], evaluator, consolidator)
    try:
        head = waits.gather(
            [consolidator.node_id.remote(), evaluator.node_id.remote()],
            "start: the head node's actors",
            [
                placement.on_head("consolidator", plan.consolidator_cpus),
                placement.on_head("evaluator", plan.evaluator_cpus),
            ],
            bound_s=bound,
        )
        actors.pg = placement.create_placement_group(
            plan, cfg.placement.wait_for_resources_s, f"mazerl-{cfg.run_name}", cfg.waits.report_every_s
        )
        actors.rollouts = [
            RolloutActor.options(name=f"rollout-{i}", **placement.rollout_options(plan, actors.pg, i)).remote(
                cfg, i, cache
            )
            for i in range(plan.num_rollouts)
        ]
        actors.trainers = [
            TrainerActor.options(name=f"trainer-{r}", **placement.trainer_options(plan, actors.pg, r)).remote(
                cfg, r, plan.num_pairs, cache
            )
            for r in range(plan.num_pairs)
        ]
        addr, port = waits.one(actors.trainers[0].rendezvous_address.remote(), "start: rendezvous", "trainer-0", bound)
        started = waits.gather(
            [t.setup.remote(addr, port) for t in actors.trainers] + [r.ready.remote() for r in actors.rollouts],
            "start: trainer ranks joining, engines starting",
            [f"trainer-{r}" for r in range(plan.num_pairs)] + [f"rollout-{i}" for i in range(plan.num_rollouts)],
            bound_s=bound,
        )
    except BaseException:
        shutdown(actors)
        raise
    names = ["consolidator", "evaluator"] + [f"trainer-{r}" for r in range(plan.num_pairs)]
    names += [f"rollout-{i}" for i in range(plan.num_rollouts)]
    actors.nodes = dict(zip(names, head + [s["node"] for s in started]))
    actors.device_name = started[0]["device_name"]
    write_placement(cfg, actors.nodes)
    return actors


def write_placement(cfg: Config, nodes: dict[str, str]) -> None:
    """<run dir>/placement.json: which node each actor landed on (node ids as the Ray Dashboard shows them)."""
    run_dir = Path(cfg.output_dir) / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "placement.json").write_text(json.dumps(nodes, indent=1))
    log.info("actors placed: %s", ", ".join(f"{a} on {n[:8]}" for a, n in nodes.items()))


def shutdown(actors: Actors) -> None:
    for a in actors.rollouts + actors.trainers + [actors.evaluator, actors.consolidator]:
        with contextlib.suppress(Exception):
            ray.kill(a)
    if actors.pg is not None:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(actors.pg)
