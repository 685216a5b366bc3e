"""Never lose a run: deterministic resume after a kill, resume on fewer ranks, S3 copies. (Node losses: the
rehearsal, tests/driver/test_reference_rehearsal.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "train.mazes_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_turns=9",
    "rollout.max_new_tokens=8",
    "eval.num_mazes=4",
    "eval.eval_interval=0",
    "eval.at_start=false",
    "checkpoint.ckpt_interval=2",
    "checkpoint.hf_save_interval=0",
    "placement.cpus_per_bundle=0.5",
    "metrics.progress_bar=false",
    "sft.steps=2",
    "sft.lr=0.01",
    "train.lr=0.01",
]


def driver(out: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """The job as a user starts it: its own process, with its own local Ray cluster."""
    return subprocess.Popen(
        [sys.executable, "-m", "app.main", "tests/tiny.yaml", f"output_dir={out}", *BASE, *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def trained_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines) if "train_loss" in e]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and step in trained_steps(run_dir):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    raise TimeoutError(f"step {step} not reached")


def final_adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "adapter_model.safetensors"))


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bitwise_equal(tmp_path):
    """SIGKILL after step 3 (checkpoint at 2), resubmit: step 4's adapter equals an uninterrupted run's."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    finish(driver(whole, "train.max_steps=4"))
    proc = driver(killed, "train.max_steps=4")
    wait_for_step(killed / "tiny", 3, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray cluster it started
    proc.wait()
    assert (killed / "tiny" / "checkpoints" / "latest").read_text().strip() == "global_step_000002"
    out = finish(driver(killed, "train.max_steps=4"))
    assert "resuming from checkpoint" in out and "global_step_000002" in out
    a, b = final_adapter(whole / "tiny"), final_adapter(killed / "tiny")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise: same seeds, same data, same reduction order
    first = final_adapter(whole / "tiny")
    assert any(t.abs().sum() > 0 for k, t in first.items() if "lora_B" in k)  # the adapter actually trained


@pytest.mark.slow
def test_checkpoint_resumes_on_a_different_number_of_trainer_ranks(tmp_path):
    finish(driver(tmp_path, "train.max_steps=2", "placement.num_bundles=2"))
    out = finish(driver(tmp_path, "train.max_steps=4", "placement.num_bundles=1"))
    assert "resuming from checkpoint" in out
    assert trained_steps(tmp_path / "tiny")[-2:] == [3, 4]


@pytest.mark.s3
def test_adapters_and_checkpoints_reach_s3_without_leaking_credentials(ceph_s3, tmp_path):
    bucket, client = ceph_s3.new_bucket("mazerl-runs"), ceph_s3.client()
    out = finish(
        driver(
            tmp_path,
            "train.max_steps=2",
            "checkpoint.hf_save_interval=1",
            f"checkpoint.s3_uri=s3://{bucket}/runs/tiny",
            f"checkpoint.s3_endpoint_url={ceph_s3.endpoint_url}",
            env=ceph_s3.env(),
        )
    )
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/tiny/")["Contents"]}
    for step in (1, 2):
        assert f"runs/tiny/export/global_step_{step:06d}/adapter_model.safetensors" in keys
    assert "runs/tiny/checkpoints/latest" in keys
    assert "runs/tiny/checkpoints/global_step_000002/MANIFEST.json" in keys
    # nothing the run wrote or printed carries the credentials
    texts = [out] + [
        p.read_text(errors="ignore")
        for p in (tmp_path / "tiny").rglob("*")
        if p.is_file() and p.suffix in (".json", ".jsonl", ".yaml", "")
    ]
    for key in keys:
        if key.endswith((".json", "latest")):
            texts.append(client.get_object(Bucket=bucket, Key=key)["Body"].read().decode(errors="ignore"))
    for text in texts:
        assert ceph_s3.secret_key not in text and ceph_s3.access_key not in text
