"""The reference run rehearsed on a CPU (tests/driver/scenarios/reference.py) at a size that fits CI: a head and
3 worker nodes of one bundle each, an adapter_init from scripts/sft.py, 15 turns with the whole history, checkpoints
to a shared folder and to Ceph RGW. A worker lost while the other ranks train, the consolidator's node lost while it
writes a checkpoint, S3 stopped for a minute: each run ends, and ends with the clean run's adapter, bit for bit.
The full shape (2 bundles a worker: 6 ranks, 6 rollout actors) is the same command without --bundles-per-node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(1500)  # beyond the scenario process's own bound, so that the gateway is resumed after it
def test_the_reference_run_survives_its_node_losses_and_an_s3_outage(ceph_s3, tmp_path):
    bucket = ceph_s3.new_bucket("rehearsal")
    env = {
        **os.environ,
        **ceph_s3.env(),
        "MAZERL_REHEARSAL_S3_URI": f"s3://{bucket}/rehearsal",
        "MAZERL_REHEARSAL_S3_ENDPOINT": ceph_s3.endpoint_url,
        "MAZERL_REHEARSAL_S3_PID": str(ceph_s3.gateway_pid),
    }
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.driver.scenarios.reference",
                str(tmp_path),
                "--bundles-per-node",
                "1",
                "--steps",
                "3",
                "--scenarios",
                "clean,worker_lost,head_lost,s3_outage",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1380,
        )
    finally:  # the scenario resumes the gateway it stops; if it was killed mid-outage, the session's S3 must go on
        os.kill(ceph_s3.gateway_pid, signal.SIGCONT)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"scenario"') or x.startswith('{"equal')]
    reports = {r["scenario"]: r for r in lines if "scenario" in r}
    assert set(reports) == {"clean", "worker_lost", "head_lost", "s3_outage"}, done.stdout[-3000:] + done.stderr[-3000:]
    for name, report in reports.items():
        assert report["code"] == 0 and report["steps"][-1] == 3, (name, report)
    assert lines[-1]["equal_to_clean"] == {name: True for name in reports}  # bit for bit, whatever was lost
    for name in ("worker_lost", "head_lost"):
        report = reports[name]
        assert report["detect_s"] is not None and report["detect_s"] < 60, report  # Ray notices a lost node
        assert report["resumed_from"] == report["lost_after_step"], report  # the newest complete checkpoint
    assert reports["head_lost"]["caught_mid_write"]
    outage = reports["s3_outage"]
    assert outage["steps_trained_while_s3_was_down"], outage  # the run went on while S3 answered nothing
    client = ceph_s3.client()
    latest = client.get_object(Bucket=bucket, Key="rehearsal/s3_outage/checkpoints/latest")["Body"].read().decode()
    assert latest == "global_step_000003"  # the copies caught up: nothing lost
