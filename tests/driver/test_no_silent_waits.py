"""No wait of the driver is silent or unbounded: four scenarios on a real multi-node Ray cluster, each in its own
process (tests/driver/scenarios/waits.py), each ending in recovery or a clear error within its bound."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def scenario(name: str, out: Path, timeout: float = 900) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.driver.scenarios.waits", name, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    logs = done.stdout + done.stderr
    lines = [x for x in done.stdout.strip().splitlines() if x.startswith("{")]
    assert lines, logs[-4000:]
    return json.loads(lines[-1]), logs


@pytest.mark.slow
def test_the_heads_actors_are_placed_before_the_placement_group_can_take_the_head(tmp_path):
    report, logs = scenario("head_starved", tmp_path)
    assert report["code"] == 0 and report["steps"] == [1, 2], logs[-3000:]
    placed, head = report["placed"], report["head"]
    assert placed["consolidator"] == head and placed["evaluator"] == head
    assert all(placed[f"{kind}-{i}"] != head for kind in ("trainer", "rollout") for i in (0, 1))


@pytest.mark.slow
def test_a_rollout_actor_that_never_answers_is_a_stall_and_the_run_recovers(tmp_path):
    report, logs = scenario("stuck_rollout", tmp_path)
    assert report["code"] == 0 and report["recovered"], logs[-3000:]
    assert report["stalls"] == 1 and report["recoveries"] == 1
    assert report["steps"][-1] == 4 and report["latest"] == "global_step_000004"
    assert "stall: rollout: no answer from rollout-0" in logs
    assert "waiting for rollout: " in logs  # the job spoke while it waited


@pytest.mark.slow
def test_a_trainer_rank_that_never_joins_is_a_stall_at_start_and_the_run_recovers(tmp_path):
    report, logs = scenario("trainer_never_joins", tmp_path)
    assert report["stopped_pid"] and report["code"] == 0, logs[-3000:]
    assert report["stalls"] == 1 and report["recoveries"] == 1 and report["steps"] == [1, 2]
    # trainer-0 waits inside the process group for its stopped peer: the stall may name both ranks
    assert re.search(r"stall: start: [^\n]*no answer from [^\n]*trainer-1", logs), logs[-3000:]


@pytest.mark.slow
def test_a_node_that_never_comes_back_ends_in_a_clear_error_with_the_checkpoint_intact(tmp_path):
    report, logs = scenario("node_never_returns", tmp_path)
    assert report["code"] == 1, logs[-3000:]
    assert report["gave_up_after_s"] < 120  # one wait of placement.wait_for_resources_s (15 s), and the detection
    assert report["latest"] == f"global_step_{report['steps'][-1]:06d}" and report["latest_loads_step"] >= 2
    assert "waiting for the placement group" in logs and "giving up after 1 recoveries" in logs


def test_a_stale_cluster_address_left_by_a_dead_cluster_does_not_hold_the_job():
    """Ray records the last cluster started on a machine in ray_current_cluster; a job given no address starts its
    own cluster even when that file names one that is gone (killed, crashed), instead of waiting on it."""
    temp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's unix sockets live under it
    (temp / "ray").mkdir()
    (temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(temp)}
    probe = "from app.config import Config; from app.driver.cluster import connect_ray; ray = connect_ray(Config())\n"
    probe += "print('nodes', len(ray.nodes())); ray.shutdown()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the job waited on the dead cluster's address")
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "nodes 1" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
