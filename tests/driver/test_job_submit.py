"""`ray job submit` against a local `ray start --head` runs the tiny job to completion, from a fresh shell: the
venv not activated (its bin/ not on PATH), the commands as the README writes them (.venv/bin/ray, and the venv's
python named by its absolute path, since the job runs in an uploaded copy of the working directory)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A separate single-node cluster, started as the README says, from a shell whose PATH has no venv."""
    bin_dir = str(Path(sys.executable).parent)
    path = ":".join(p for p in os.environ["PATH"].split(":") if p != bin_dir and "/.venv/" not in p + "/")
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "disabled"}
    env.pop("VIRTUAL_ENV", None)
    port, dash = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    head = subprocess.Popen(
        [
            f"{bin_dir}/ray",
            "start",
            "--head",
            f"--port={port}",
            f"--dashboard-port={dash}",
            # every fixed default port of `ray start --head`: the session's test cluster (conftest.ray_cluster) may
            # hold them, and a head whose job agent cannot bind its port never runs a job
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=2",
            "--block",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 180
    # Up means a job runs: the dashboard answers `ray job list` before the node's job agent has registered, and a
    # submit then fails with "No available agent to submit job" (seen on a loaded 2-core machine).
    while (
        subprocess.run(
            [f"{bin_dir}/ray", "job", "submit", "--address", address, "--", "true"], env=env, capture_output=True
        ).returncode
        != 0
    ):
        assert time.monotonic() < deadline and head.poll() is None, "ray start --head did not come up to run a job"
        time.sleep(2)
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops what it started
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_job_submit_trains_the_tiny_job(ray_head, tmp_path):
    address, env = ray_head
    bin_dir = str(Path(sys.executable).parent)
    out = subprocess.run(
        [
            f"{bin_dir}/ray",
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            "--",
            f"{bin_dir}/python",
            "-m",
            "app.main",
            "tests/tiny.yaml",
            f"output_dir={tmp_path / 'runs'}",
            "train.max_steps=1",
            "train.mazes_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_turns=9",
            "rollout.max_new_tokens=8",
            "eval.num_mazes=4",
            "eval.at_start=false",
            "metrics.progress_bar=false",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0 and "succeeded" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
    assert "step 1/1 | eval solve" in out.stdout  # the driver's per-step line reaches the job log
    log = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("step") == 1 and "train_loss" in m for m in log)
