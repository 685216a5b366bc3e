"""No wait of the driver is silent or unbounded: four scenarios on a real multi-node Ray cluster, each in its own
process (tests/driver/scenarios/waits.py), each ending in recovery or a clear error within its bound."""

from __future__ import annotations

import json
import subprocess
import sys
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
    assert "no answer from trainer-1" in logs


@pytest.mark.slow
def test_a_node_that_never_comes_back_ends_in_a_clear_error_with_the_checkpoint_intact(tmp_path):
    report, logs = scenario("node_never_returns", tmp_path)
    assert report["code"] == 1, logs[-3000:]
    assert report["gave_up_after_s"] < 120  # one wait of placement.wait_for_resources_s (15 s), and the detection
    assert report["latest"] == f"global_step_{report['steps'][-1]:06d}" and report["latest_loads_step"] >= 2
    assert "waiting for the placement group" in logs and "giving up after 1 recoveries" in logs
