"""Scenario: a worker node dies mid-run; the driver recovers on a fresh node and finishes.

Run as its own process (its own multi-node Ray cluster): python -m tests.driver.scenarios.node_loss OUT_DIR
The head node (1 CPU, the `head` resource) holds the evaluator and the consolidator; the trainer and
rollout bundles fit only on the worker node. After step 3 the worker is removed (its actors die with
it); a few seconds later a fresh worker joins. Prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def wait_for_step(log: Path, step: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("step", 0) >= step and "train_loss" in entry:
                    return True
        time.sleep(0.5)
    return False


def main(out_dir: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from app.main import main as run

    root = Path(__file__).resolve().parents[3]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address)
    overrides = [
        f"output_dir={out_dir}",
        "train.max_steps=6",
        "train.mazes_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_turns=9",
        "rollout.max_new_tokens=8",
        "eval.num_mazes=4",
        "eval.eval_interval=0",
        "eval.at_start=false",
        "checkpoint.ckpt_interval=2",
        "checkpoint.hf_save_interval=0",
        "placement.cpus_per_bundle=1",
        "placement.wait_for_resources_s=120",
        "metrics.progress_bar=false",
    ]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(code=run([str(root / "configs" / "tiny.yaml"), *overrides])))
    thread.start()
    log = Path(out_dir) / "tiny" / "metrics.jsonl"
    if not wait_for_step(log, 3, 600):
        print(json.dumps({"error": "step 3 never came"}))
        return 1
    worker_node_id = worker.node_id
    cluster.remove_node(worker)
    removed_at = time.time()
    time.sleep(5)
    cluster.add_node(num_cpus=2)
    thread.join(timeout=900)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e["step"] for e in entries if "train_loss" in e]
    report = {
        "code": result.get("code"),
        "steps": steps,
        "removed_node": worker_node_id,
        "removed_at": removed_at,
        "recoveries": max((e.get("recoveries", 0) for e in entries), default=0),
        "resumed_from": next((e["step"] for e in entries if e.get("recovery_at")), None),
    }
    print(json.dumps(report))
    ray.shutdown()
    cluster.shutdown()
    return 0 if report["code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
