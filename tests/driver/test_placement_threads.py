"""The threads a colocated pair computes with, on a real Ray cluster: the whole bundle's CPUs for each of the two,
where Ray alone would give each the floor of its half (1 thread of a 1.8-CPU bundle: one core of two left idle in
every phase of the default job)."""

from __future__ import annotations

import ray

from app.config import load_config
from placement import plan as placement


@ray.remote
class Probe:
    def threads(self) -> tuple[int, str | None]:
        import os

        import torch

        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_a_colocated_trainer_and_rollout_actor_each_compute_with_the_bundles_cpus(ray_cluster):
    plan = placement.make_plan(load_config(None, ["placement.cpus_per_bundle=1.8"]))
    pg = placement.create_placement_group(plan, 60, "threads-probe")
    try:
        trainer = Probe.options(**placement.trainer_options(plan, pg, 0)).remote()
        rollout = Probe.options(**placement.rollout_options(plan, pg, 0)).remote()
        bare = Probe.options(num_cpus=0.9).remote()  # what Ray gives a 0.9-CPU actor on its own
        assert ray.get([trainer.threads.remote(), rollout.threads.remote()]) == [(2, "2"), (2, "2")]
        assert ray.get(bare.threads.remote()) == (1, "1")
    finally:
        ray.util.remove_placement_group(pg)
