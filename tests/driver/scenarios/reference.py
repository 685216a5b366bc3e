"""The reference run rehearsed at its shape on a CPU: a head and 3 worker nodes (ray.cluster_utils), 2 bundles a
worker (6 FSDP2 trainer ranks, 6 rollout actors), the evaluator and the consolidator on the head node, starting
from an adapter written by scripts/sft.py, 15 turns with the whole history, checkpoints to a shared folder and to
an S3 server (Ceph RGW when the environment names one), losing nodes on the way.

    python -m tests.driver.scenarios.reference OUT [--bundles-per-node 2] [--steps 4] [--scenarios clean,...]

Scenarios (each a fresh cluster and driver; OUT/<scenario>/ holds its run):
  clean            the run as it should go; its final adapter is the reference for the others
  worker_lost      a worker node removed while trainer ranks run a step (the survivors inside FSDP's collectives);
                   a replacement node joins 20 s later
  head_lost        the node of the consolidator (and evaluator) removed while it writes a checkpoint; a replacement
                   joins 10 s later; the previous checkpoint is the one resumed from
  s3_outage        the S3 server stopped (SIGSTOP) for 60 s mid-run: copies wait and catch up, the run goes on
S3: MAZERL_REHEARSAL_S3_URI, MAZERL_REHEARSAL_S3_ENDPOINT and, for s3_outage, MAZERL_REHEARSAL_S3_PID (the gateway's
process), with the credentials in the usual AWS_* variables (`python -m tests.s3_server start DIR` prints them all).
Prints one JSON line a scenario: exit code, steps trained, recoveries, time to detect the loss (from the kill to the
driver's "lost" line), time to recover (from that line to the next step trained), steps redone, and whether the
final adapter equals the clean run's bit for bit. In this rehearsal the `head` resource sits on its own node,
apart from the node of Ray's control store, so that the consolidator's node can be lost without the cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tests.driver.scenarios.processes import actor_pids, in_method

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "tests" / "tiny.yaml")


def settings(bundles: int, steps: int, out: Path, adapter: Path) -> list[str]:
    return [
        f"output_dir={out}",
        f"model.adapter_init={adapter}",
        f"placement.num_bundles={bundles}",
        "placement.cpus_per_bundle=1",
        "placement.wait_for_resources_s=180",
        f"train.max_steps={steps}",
        f"train.mazes_per_step={bundles}",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_turns=15",
        "rollout.image_history=0",
        "rollout.turn_history=0",
        "rollout.max_new_tokens=8",
        "rollout.max_model_len=4096",
        "maze.size=7",
        "eval.num_mazes=4",
        "eval.at_start=false",
        "eval.eval_interval=0",
        "checkpoint.ckpt_interval=1",
        "checkpoint.hf_save_interval=0",
        "checkpoint.max_failures=2",
        "waits.collective_s=60",
        "waits.report_every_s=5",
        "metrics.progress_bar=false",
    ]


class Lines(logging.Handler):
    """The driver's log lines with their times, to measure when it noticed a loss."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[float, str]] = []

    def emit(self, record):
        self.records.append((record.created, record.getMessage()))

    def first(self, text: str) -> float | None:
        return next((t for t, m in self.records if text in m), None)


def records(run_dir: Path) -> list[dict]:
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(x) for x in lines if x.endswith("}")]  # the last line may be half written


def steps_of(run_dir: Path) -> list[int]:
    return [e["step"] for e in records(run_dir) if "train_loss" in e]


def wait_for(condition, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def writing(checkpoints: Path) -> bool:
    """Whether a checkpoint is being written (its temporary folder exists)."""
    return checkpoints.is_dir() and any(p.name.startswith(".tmp-") for p in checkpoints.iterdir())


def final_adapter_digest(run_dir: Path) -> str | None:
    import hashlib

    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    return hashlib.sha256(
        (run_dir / "checkpoints" / latest.read_text().strip() / "adapter_model.safetensors").read_bytes()
    ).hexdigest()


def running_train_steps() -> int:
    """How many trainer ranks are inside a training step now."""
    return sum(in_method(pid, "TrainerActor.step") for pid in actor_pids("trainer-").values())


def run_scenario(name: str, out: Path, bundles_per_node: int, steps: int, adapter: Path, s3: list[str]) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from app.main import main as driver

    workers = 3
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # Ray's control store only
    head = cluster.add_node(num_cpus=1, resources={"head": 1})  # the head pod: consolidator, evaluator
    nodes = [cluster.add_node(num_cpus=bundles_per_node) for _ in range(workers)]
    ray.init(address=cluster.address)
    lines = Lines()
    logging.getLogger("mazerl").addHandler(lines)
    run_dir = out / name / "tiny"
    overrides = settings(workers * bundles_per_node, steps, out / name, adapter) + s3
    result: dict = {"scenario": name}
    thread = threading.Thread(target=lambda: result.update(code=driver([TINY, *overrides])), daemon=True)
    started = time.monotonic()
    thread.start()
    killed_at = None
    try:
        if name == "worker_lost":
            wait_for(lambda: 2 in steps_of(run_dir), 900, 0.5)
            wait_for(lambda: running_train_steps() >= workers * bundles_per_node - 1, 600, 0.05)
            cluster.remove_node(nodes[-1], allow_graceful=False)
            killed_at, lost_step = time.time(), max(steps_of(run_dir))
            time.sleep(20)
            cluster.add_node(num_cpus=bundles_per_node)
        elif name == "head_lost":
            ckpts = run_dir / "checkpoints"
            wait_for(lambda: 1 in steps_of(run_dir), 900, 0.5)
            writer = actor_pids("consolidator")["consolidator"]
            caught, deadline = False, time.monotonic() + 600
            while not caught and thread.is_alive() and time.monotonic() < deadline:
                # A checkpoint's temporary folder lives for milliseconds: the writer is frozen the moment one is seen,
                # and the node is lost only if the folder is still there, so the loss lands inside the write.
                if wait_for(lambda: writing(ckpts), 5, 0.002):
                    os.kill(writer, signal.SIGSTOP)
                    caught = writing(ckpts)
                    if not caught:
                        os.kill(writer, signal.SIGCONT)
            cluster.remove_node(head, allow_graceful=False)
            killed_at, lost_step = time.time(), max(steps_of(run_dir))
            result["caught_mid_write"] = caught
            time.sleep(10)
            cluster.add_node(num_cpus=1, resources={"head": 1})
        elif name == "s3_outage":
            wait_for(lambda: 1 in steps_of(run_dir), 900, 0.5)
            rgw = int(os.environ["MAZERL_REHEARSAL_S3_PID"])
            os.kill(rgw, signal.SIGSTOP)
            try:
                stopped = time.monotonic()
                steps_during = []
                while time.monotonic() - stopped < 60:
                    time.sleep(1)
                    steps_during = steps_of(run_dir)
            finally:  # a gateway left stopped would hang every later S3 user
                os.kill(rgw, signal.SIGCONT)
            result["steps_trained_while_s3_was_down"] = sorted(set(steps_during) - {1})
        thread.join(timeout=1800)
    finally:
        logging.getLogger("mazerl").removeHandler(lines)
        ray.shutdown()
        cluster.shutdown()
    steps_trained = steps_of(run_dir)
    result.update(
        steps=steps_trained, wall_s=round(time.monotonic() - started, 1), digest=final_adapter_digest(run_dir)
    )
    if killed_at is not None:
        noticed = lines.first("lost an actor or node")
        resumed = next((m for _, m in lines.records if m.startswith("resuming from checkpoint")), "")
        resumed_from = int(resumed.rsplit("(step ", 1)[1].rstrip(")")) if "(step " in resumed else 0
        after = [e["time"] for e in records(run_dir) if "train_loss" in e and noticed and e["time"] > noticed]
        result.update(
            detect_s=round(noticed - killed_at, 1) if noticed else None,
            recover_s=round(after[0] - noticed, 1) if after else None,
            resumed_from=resumed_from,
            lost_after_step=lost_step,
            steps_redone=len(steps_trained) - len(set(steps_trained)),  # completed steps trained twice
        )
    return result


def make_adapter(out: Path) -> Path:
    """A warm start written by scripts/sft.py, as the reference run's adapter_init is."""
    from scripts.sft import main as sft

    adapter = out / "sft"
    if not (adapter / "final" / "adapter_config.json").exists():
        code = sft(
            [
                TINY,
                str(adapter),
                f"output_dir={out}",
                "sft.steps=4",
                "sft.lr=3e-3",
                "sft.mazes_per_step=4",
                "eval.num_mazes=2",
                "maze.size=7",
            ]
        )
        assert code == 0, "scripts/sft.py failed"
    return adapter / "final"


def make_bucket(uri: str, endpoint_url: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    bucket = uri.removeprefix("s3://").split("/", 1)[0]
    if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--bundles-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--scenarios", default="clean,worker_lost,head_lost,s3_outage")
    args = ap.parse_args(argv)
    if "s3_outage" in args.scenarios.split(",") and not os.environ.get("MAZERL_REHEARSAL_S3_PID"):
        ap.error("s3_outage stops the S3 gateway: set MAZERL_REHEARSAL_S3_URI, _ENDPOINT and _PID")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    adapter = make_adapter(out)
    s3 = []
    if os.environ.get("MAZERL_REHEARSAL_S3_URI"):
        make_bucket(os.environ["MAZERL_REHEARSAL_S3_URI"], os.environ["MAZERL_REHEARSAL_S3_ENDPOINT"])
        s3 = [
            f"checkpoint.s3_uri={os.environ['MAZERL_REHEARSAL_S3_URI']}",
            f"checkpoint.s3_endpoint_url={os.environ['MAZERL_REHEARSAL_S3_ENDPOINT']}",
        ]
    reports = []
    for name in args.scenarios.split(","):
        # each scenario its own prefix under the given one
        scenario_s3 = [f"{s.rstrip('/')}/{name}" if s.startswith("checkpoint.s3_uri=") else s for s in s3]
        report = run_scenario(name, out, args.bundles_per_node, args.steps, adapter, scenario_s3)
        reports.append(report)
        print(json.dumps(report), flush=True)
    clean = next((r["digest"] for r in reports if r["scenario"] == "clean"), None)
    if clean:
        print(json.dumps({"equal_to_clean": {r["scenario"]: r["digest"] == clean for r in reports}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
