"""Scenarios: no wait of the driver is silent or unbounded, on a real multi-node Ray cluster (ray.cluster_utils).

Run as its own process (its own cluster): python -m tests.driver.scenarios.waits SCENARIO OUT_DIR
Prints one JSON line last: the run's exit code, the steps it trained, its recoveries and stalls, and timings.

  head_starved      a CPU-only cluster whose head has 1 CPU, workers 1 CPU each, bundles of 1 CPU: the head's
                    actors (consolidator, evaluator) must get their share before the placement group takes it
  stuck_rollout     rollout-0's process is stopped (SIGSTOP) after step 1: the rollout phase stalls past its
                    bound, the driver recovers from the newest checkpoint and finishes
  trainer_never_joins  trainer-1's process is stopped before it can join the process group: the start stalls
                    past waits.actor_start_s, the driver recovers and finishes
  node_never_returns   the worker node is removed after step 2 and never replaced: the driver gives up after
                    checkpoint.max_failures waits of placement.wait_for_resources_s, with a clear error, and the
                    last checkpoint stays intact
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tests.driver.scenarios.processes import actor_pids, in_method

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[3]
BASE = [
    "train.mazes_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_turns=9",
    "rollout.max_new_tokens=8",
    "eval.num_mazes=4",
    "eval.eval_interval=0",
    "eval.at_start=false",
    "checkpoint.ckpt_interval=1",
    "checkpoint.hf_save_interval=0",
    "metrics.progress_bar=false",
    "waits.report_every_s=2",
]


def trained(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [e["step"] for e in map(json.loads, log.read_text().splitlines()) if "train_loss" in e]


def wait_for(condition, timeout: float, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def run_driver(overrides: list[str], out_dir: str, result: dict) -> threading.Thread:
    from app.main import main as run

    def target():
        started = time.monotonic()
        result["code"] = run([str(ROOT / "tests" / "tiny.yaml"), f"output_dir={out_dir}", *BASE, *overrides])
        result["driver_s"] = time.monotonic() - started

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def report(out_dir: str, result: dict, **extra) -> dict:
    run_dir = Path(out_dir) / "tiny"
    entries = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    latest = run_dir / "checkpoints" / "latest"
    return {
        **result,
        **extra,
        "steps": [e["step"] for e in entries if "train_loss" in e],
        "recoveries": max((e.get("recoveries", 0) for e in entries), default=0),
        "stalls": max((e.get("stalls", 0) for e in entries), default=0),
        "latest": latest.read_text().strip() if latest.exists() else None,
    }


def head_starved(cluster, out_dir: str) -> dict:
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    import ray

    ray.init(address=cluster.address)
    result: dict = {}
    thread = run_driver(
        [
            "train.max_steps=2",
            "placement.cpus_per_bundle=1",
            "waits.actor_start_s=120",
            "placement.wait_for_resources_s=60",
        ],
        out_dir,
        result,
    )
    thread.join(timeout=600)
    head = cluster.head_node.node_id
    placed = json.loads((Path(out_dir) / "tiny" / "placement.json").read_text())
    return report(out_dir, result, head=head, placed=placed)


def stuck_rollout(cluster, out_dir: str) -> dict:
    cluster.add_node(num_cpus=2)
    import ray

    ray.init(address=cluster.address)
    result: dict = {}
    # the rollout phase of these steps takes a few seconds: 20 s without an answer is a stall
    thread = run_driver(["train.max_steps=4", "placement.cpus_per_bundle=1", "waits.phase_s=20"], out_dir, result)
    log = Path(out_dir) / "tiny" / "metrics.jsonl"
    if not wait_for(lambda: 1 in trained(log), 600):
        return report(out_dir, result, error="step 1 never came")
    wait_for(lambda: "rollout-0" in actor_pids("rollout-0"), 120)
    pid = actor_pids("rollout-0")["rollout-0"]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    recovered = wait_for(lambda: trained(log).count(2) >= 1 and len(trained(log)) >= 2, 600)
    thread.join(timeout=600)
    return report(
        out_dir, result, stopped_pid=pid, recovered=recovered, detect_and_recover_s=time.monotonic() - stopped_at
    )


def trainer_never_joins(cluster, out_dir: str) -> dict:
    """trainer-1 is stopped while it sets up its rank (joining the process group, building its model): it never
    answers, and the start stalls past waits.actor_start_s."""
    cluster.add_node(num_cpus=2)
    import ray

    ray.init(address=cluster.address)
    result: dict = {}
    thread = run_driver(["train.max_steps=2", "placement.cpus_per_bundle=1", "waits.actor_start_s=45"], out_dir, result)
    pid: list[int] = []
    wait_for(lambda: pid.extend(actor_pids("trainer-1").values()) or pid, 300, every=0.01)
    caught = wait_for(lambda: in_method(pid[0], "TrainerActor.setup"), 120, every=0.005)  # the setup takes seconds
    if caught:
        os.kill(pid[0], signal.SIGSTOP)
    thread.join(timeout=900)
    return report(out_dir, result, stopped_pid=pid[0] if caught else None)


def node_never_returns(cluster, out_dir: str) -> dict:
    worker = cluster.add_node(num_cpus=2)
    import ray

    ray.init(address=cluster.address)
    result: dict = {}
    overrides = [
        "train.max_steps=6",
        "placement.cpus_per_bundle=1",
        "placement.wait_for_resources_s=15",
        "checkpoint.max_failures=1",
    ]
    thread = run_driver(overrides, out_dir, result)
    log = Path(out_dir) / "tiny" / "metrics.jsonl"
    if not wait_for(lambda: 2 in trained(log), 600):
        return report(out_dir, result, error="step 2 never came")
    cluster.remove_node(worker)
    removed_at = time.monotonic()
    thread.join(timeout=600)
    from app.storage import checkpoint

    latest = checkpoint.load_checkpoint(str(Path(out_dir) / "tiny" / "checkpoints"))
    return report(out_dir, result, gave_up_after_s=time.monotonic() - removed_at, latest_loads_step=latest.step)


SCENARIOS = {f.__name__: f for f in (head_starved, stuck_rollout, trainer_never_joins, node_never_returns)}


def main(scenario: str, out_dir: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    try:
        print(json.dumps(SCENARIOS[scenario](cluster, out_dir)), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
