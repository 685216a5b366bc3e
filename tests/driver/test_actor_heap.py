"""The actors' long-lived heap is frozen out of the garbage collector's full passes (actors/heap.py): a full pass in
a process that imported torch and transformers and built a model walks every one of their objects otherwise, and in
a rollout actor that pause stops the thread that feeds the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ray

from actors.rollout import RolloutActor
from actors.trainer import TrainerActor
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]

FULL_PASSES = """
import gc, statistics, time
import torch, transformers  # the libraries every actor imports
from transformers import AutoConfig  # noqa: F401
from actors.heap import freeze_heap

def full_pass() -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
    return statistics.median(times)

before = full_pass()
frozen = freeze_heap()
print(frozen, before, full_pass())
"""


def test_a_frozen_heap_leaves_the_full_pass_only_what_was_made_after_it():
    done = subprocess.run(
        [sys.executable, "-c", FULL_PASSES], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    frozen, before, after = done.stdout.split()
    assert int(frozen) > 50_000  # torch and transformers alone
    assert float(after) < float(before) / 10, (before, after)


def test_the_rollout_and_trainer_actors_freeze_their_heaps_once_their_models_are_built(ray_cluster, model_cache):
    cfg = tiny_config("placement.num_bundles=1")
    rollout = RolloutActor.options(num_cpus=0.5).remote(cfg, 0, str(model_cache))
    trainer = TrainerActor.options(num_cpus=0.5).remote(cfg, 0, 1, str(model_cache))
    try:
        addr, port = ray.get(trainer.rendezvous_address.remote(), timeout=120)
        started = ray.get([rollout.ready.remote(), trainer.setup.remote(addr, port)], timeout=600)
        # the model and the libraries: hundreds of thousands of objects, none of them walked by a full pass again
        assert all(s["frozen_objects"] > 100_000 for s in started), [s["frozen_objects"] for s in started]
    finally:
        ray.kill(rollout)
        ray.kill(trainer)
