"""From the config to Ray resources: one placement group, and where each actor goes.

Colocated (the default): N bundles; rollout actor i and trainer rank i share bundle i, each with half
its GPU and half its CPUs, and take turns (the engine sleeps while the trainer trains). Not colocated:
2N bundles, rollout actors in the first N, trainers in the last N, each with a whole bundle. With
placement.rollouts_per_bundle M, M rollout actors share what one would have had in a bundle (rollout actor j
sits in bundle j // M): an in-process vLLM engine prepares its requests on one host thread, and a small model
leaves the GPU idle while it does (docs/BENCHMARKS.md). The consolidator is pinned to the head node because it
writes to the head's shared directory and outlives worker nodes; the evaluator, which needs only a little CPU, goes
there too, so that a lost worker never takes it along. Both are placed before the placement group (app/driver/
cluster.py), so the head's share is theirs on any cluster, as `simulate` assumes.

Threads: Ray gives each actor OMP_NUM_THREADS of its own CPU share, rounded down (1 for a colocated pair's halves
of a 1-CPU bundle). A colocated pair's phases alternate, so each of the two computes alone and is given the whole
bundle's CPUs as torch threads (placement.threads overrides); M rollout actors of a bundle play at once and share them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import Config, ConfigError

HEAD_RESOURCE = "head"  # KubeRay's head pod advertises it (deploy/k8s); Ray's own marker is the fallback
RAY_HEAD_MARKER = "node:__internal_head__"
log = logging.getLogger("mazerl")


def in_ray_units(amount: float) -> float:
    """A resource amount as Ray counts it (in ten-thousandths), so that 1.8 + 0.1 + 0.1 CPUs fit a 2-CPU node."""
    return round(amount, 4)


@dataclass(frozen=True)
class Plan:
    num_pairs: int
    rollouts_per_bundle: int
    colocated: bool
    bundles: list[dict]
    strategy: str
    rollout_gpus: float
    rollout_cpus: float
    trainer_gpus: float
    trainer_cpus: float
    evaluator_cpus: float
    consolidator_cpus: float
    rollout_threads: int = 1
    trainer_threads: int = 1

    @property
    def num_rollouts(self) -> int:
        return self.num_pairs * self.rollouts_per_bundle

    def rollout_bundle(self, i: int) -> int:
        return i // self.rollouts_per_bundle

    def trainer_bundle(self, i: int) -> int:
        return i if self.colocated else self.num_pairs + i

    @property
    def total_gpus(self) -> float:
        return in_ray_units(sum(b.get("GPU", 0) for b in self.bundles))

    @property
    def total_cpus(self) -> float:
        return in_ray_units(sum(b.get("CPU", 0) for b in self.bundles) + self.evaluator_cpus + self.consolidator_cpus)


def make_plan(cfg: Config) -> Plan:
    p = cfg.placement
    n, gpus, cpus = p.num_bundles, p.gpus_per_bundle, p.cpus_per_bundle
    gpus = int(gpus) if float(gpus).is_integer() else gpus  # whole GPUs read as such in plans and in Ray
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if p.colocate_all:
        share = 0.5
        bundles = [dict(bundle) for _ in range(n)]
    else:
        share = 1.0
        bundles = [dict(bundle) for _ in range(2 * n)]
    m = p.rollouts_per_bundle
    whole = p.threads or max(1, round(cpus))  # a bundle's CPUs as threads: the phases alternate within it
    return Plan(
        num_pairs=n,
        rollouts_per_bundle=m,
        colocated=p.colocate_all,
        bundles=bundles,
        strategy="PACK",
        rollout_gpus=gpus * share / m,
        rollout_cpus=cpus * share / m,
        trainer_gpus=gpus * share,
        trainer_cpus=cpus * share,
        evaluator_cpus=p.evaluator_cpus,
        consolidator_cpus=p.consolidator_cpus,
        rollout_threads=max(1, whole // m),
        trainer_threads=whole,
    )


def check_cluster(plan: Plan, resources: dict) -> None:
    """Fails before any actor starts when the cluster can never hold the plan."""
    have_gpu, have_cpu = resources.get("GPU", 0), resources.get("CPU", 0)
    if plan.total_gpus > have_gpu:
        raise ConfigError(
            "placement.gpus_per_bundle",
            f"the plan needs {plan.total_gpus:g} GPUs, the cluster has {have_gpu:g}",
            "lower placement.num_bundles, or set gpus_per_bundle=0 on a CPU machine",
        )
    if plan.total_cpus > have_cpu:
        raise ConfigError(
            "placement.cpus_per_bundle",
            f"the plan needs {plan.total_cpus:g} CPUs, the cluster has {have_cpu:g}",
            "lower placement.cpus_per_bundle or placement.num_bundles",
        )


def check_nodes(plan: Plan, nodes: list[dict]) -> None:
    """Fails before any actor starts when no node could ever hold a bundle, or the head its actors: an impossible
    placement is an error that names what is missing, not a wait."""
    head = next((n for n in nodes if n.get(HEAD_RESOURCE)), None) or next(
        (n for n in nodes if n.get(RAY_HEAD_MARKER)), None
    )
    need = in_ray_units(plan.consolidator_cpus + plan.evaluator_cpus)
    if head is not None and head.get("CPU", 0) < need:
        raise ConfigError(
            "placement.consolidator_cpus",
            f"the consolidator and the evaluator are pinned to the head node and need CPU {need:g}; the head has "
            f"CPU {head.get('CPU', 0):g}",
            "lower placement.consolidator_cpus and placement.evaluator_cpus, or give the head node CPUs",
        )
    for b in plan.bundles:
        if not any(all(n.get(k, 0) >= v for k, v in b.items()) for n in nodes):
            biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
            field = (
                "placement.gpus_per_bundle" if b.get("GPU", 0) > biggest.get("GPU", 0) else "placement.cpus_per_bundle"
            )
            raise ConfigError(
                field,
                f"a bundle needs {b}, and no node has that much (the largest: GPU {biggest.get('GPU', 0):g}, "
                f"CPU {biggest.get('CPU', 0):g})",
                "lower placement.cpus_per_bundle / placement.gpus_per_bundle, or add larger nodes",
            )


def create_placement_group(plan: Plan, timeout_s: float, name: str = "", report_every_s: float = 10.0):
    """The placement group, ready; while it is not, a log line every report_every_s says what it waits for and
    until when; past timeout_s it is removed and a TimeoutError names the bundles and what the cluster has free."""
    pg = placement_group(plan.bundles, strategy=plan.strategy, name=name)
    start = time.monotonic()
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + timeout_s))
    ready = pg.ready()
    while time.monotonic() - start < timeout_s:
        done, _ = ray.wait([ready], timeout=min(report_every_s, max(0.0, timeout_s - (time.monotonic() - start))))
        if done:
            ray.get(ready)
            return pg
        log.info(
            "waiting for the placement group (%d bundles of %s) for %.0f s, until %s at most "
            "(placement.wait_for_resources_s); free in the cluster: %s",
            len(plan.bundles),
            plan.bundles[0],
            time.monotonic() - start,
            until,
            _free(),
        )
    ray.util.remove_placement_group(pg)
    raise TimeoutError(
        f"the placement group {plan.bundles} was not ready after {timeout_s:.0f} s; free in the cluster: {_free()} "
        "(placement.wait_for_resources_s bounds this wait)"
    )


def _free() -> dict:
    return {k: round(v, 3) for k, v in sorted(ray.available_resources().items()) if k in ("CPU", "GPU", HEAD_RESOURCE)}


def on_head(actor: str, cpus: float) -> str:
    """How a wait names a head-pinned actor: what it needs, so a stall says what is missing."""
    return f"{actor} (CPU {cpus:g} on the head node)"


def in_bundle(pg, index: int) -> dict:

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=True
        )
    }


def threads(n: int) -> dict:
    """torch's and OpenMP's threads in the actor's process: Ray leaves OMP_NUM_THREADS alone once it is set."""
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(n)}}}


def rollout_options(plan: Plan, pg, i: int) -> dict:
    where = in_bundle(pg, plan.rollout_bundle(i))
    return {"num_cpus": plan.rollout_cpus, "num_gpus": plan.rollout_gpus, **where, **threads(plan.rollout_threads)}


def trainer_options(plan: Plan, pg, i: int) -> dict:
    where = in_bundle(pg, plan.trainer_bundle(i))
    return {"num_cpus": plan.trainer_cpus, "num_gpus": plan.trainer_gpus, **where, **threads(plan.trainer_threads)}


def evaluator_options(plan: Plan, cluster_resources: dict) -> dict:
    return {"num_cpus": plan.evaluator_cpus, "resources": {head_resource(cluster_resources): 0.001}}


def head_resource(cluster_resources: dict) -> str:
    return HEAD_RESOURCE if cluster_resources.get(HEAD_RESOURCE) else RAY_HEAD_MARKER


def consolidator_options(plan: Plan, cluster_resources: dict) -> dict:
    return {"num_cpus": plan.consolidator_cpus, "resources": {head_resource(cluster_resources): 0.001}}


def parse_cluster(spec: str) -> list[tuple[str, dict]]:
    """'head:CPU=32,head=1;3x worker:GPU=2,CPU=32' -> [(name, resources), ...] for a simulated cluster."""
    nodes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, resources = part.partition(":")
        count, _, name = name.strip().rpartition("x ") if "x " in name else ("1", "", name.strip())
        res = {}
        for item in filter(None, (r.strip() for r in resources.split(","))):
            key, _, value = item.partition("=")
            try:
                res[key.strip()] = float(value)
            except ValueError:
                raise ConfigError(
                    "--cluster",
                    f"{item!r} is not RESOURCE=NUMBER",
                    "write e.g. 'head:CPU=32,head=1;3x worker:GPU=2,CPU=32'",
                ) from None
        for i in range(int(count or 1)):
            nodes.append((f"{name}-{i}" if int(count or 1) > 1 else name, res))
    if not nodes:
        raise ConfigError("--cluster", "no nodes described", "write e.g. 'head:CPU=32,head=1;3x worker:GPU=2,CPU=32'")
    return nodes


def simulate(plan: Plan, nodes: list[tuple[str, dict]]) -> list[str]:
    """Where Ray's PACK strategy would put each bundle: bundles fill nodes in order, as Ray packs them."""
    free = [dict(res) for _, res in nodes]
    # reserve what the head-pinned and free-floating actors need first, so bundles do not take it
    head = next((i for i, (_, r) in enumerate(nodes) if r.get(HEAD_RESOURCE)), 0)
    free[head]["CPU"] = in_ray_units(free[head].get("CPU", 0) - plan.consolidator_cpus - plan.evaluator_cpus)
    placed = []
    for b in plan.bundles:
        target = next((i for i, f in enumerate(free) if all(f.get(k, 0) >= v for k, v in b.items())), None)
        if target is None:
            raise ConfigError(
                "placement",
                f"bundle {b} fits on no node of the described cluster",
                "lower placement.cpus_per_bundle / gpus_per_bundle or describe more nodes",
            )
        for k, v in b.items():
            free[target][k] = in_ray_units(free[target][k] - v)
        placed.append(nodes[target][0])
    return placed


def describe(plan: Plan, cluster_resources: dict | None = None) -> str:
    lines = [f"placement group: {len(plan.bundles)} bundles, strategy {plan.strategy}"]
    for i, b in enumerate(plan.bundles):
        who = [
            f"rollout-{j} (GPU {plan.rollout_gpus:g}, CPU {plan.rollout_cpus:g}, {plan.rollout_threads} threads)"
            for j in range(plan.num_rollouts)
            if plan.rollout_bundle(j) == i
        ]
        for r in range(plan.num_pairs):
            if plan.trainer_bundle(r) == i:
                share = f"GPU {plan.trainer_gpus:g}, CPU {plan.trainer_cpus:g}, {plan.trainer_threads} threads"
                who.append(f"trainer-{r} ({share})")
        lines.append(f"  bundle {i}: {b} -> {', '.join(who)}")
    marker = head_resource(cluster_resources or {})
    lines.append(f"evaluator: CPU {plan.evaluator_cpus:g}, pinned to the head node (resource '{marker}')")
    lines.append(f"consolidator: CPU {plan.consolidator_cpus:g}, pinned to the head node (resource '{marker}')")
    lines.append(f"total: {plan.total_gpus:g} GPUs, {plan.total_cpus:g} CPUs")
    return "\n".join(lines)
