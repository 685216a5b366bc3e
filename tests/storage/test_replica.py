"""S3 copies made in the background (app.storage.replica): the same commit, in order, retried through an outage,
never a damaged folder."""

from __future__ import annotations

import time

import pytest
import torch

from app.storage import checkpoint
from app.storage.local import LocalStore
from app.storage.replica import Replicator, replicate
from app.storage.s3 import S3Store
from tests.s3_server import S3Endpoint, free_port


def state(step: int) -> checkpoint.TrainingState:
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    adapter = {"base_model.model.x.lora_A.weight": torch.full((4, 8), float(step))}
    return checkpoint.TrainingState(step, adapter, config, {"state.0.exp_avg": torch.ones(16) * step}, {}, {"s": step})


def bucket_store(endpoint: S3Endpoint, monkeypatch, prefix: str = "run/checkpoints", **options) -> S3Store:
    for key, value in endpoint.env().items():
        monkeypatch.setenv(key, value)
    bucket = endpoint.new_bucket()
    return S3Store(f"s3://{bucket}/{prefix}", endpoint.endpoint_url, **options)


def test_a_copy_is_the_same_checkpoint_committed_the_same_way(moto_s3, monkeypatch, tmp_path):
    local, remote = LocalStore(tmp_path / "ck"), bucket_store(moto_s3, monkeypatch)
    for step in (2, 4):
        checkpoint.save_checkpoint(local, state(step))
        replicate(local, remote, checkpoint.folder_name(step), keep_last=1)
    assert checkpoint.find_latest(remote).name == "global_step_000004"
    copied = checkpoint.load_checkpoint(remote)
    assert copied.state == {"s": 4} and torch.equal(copied.optimizer["state.0.exp_avg"], torch.ones(16) * 4)
    assert not remote.list("global_step_000002/")  # keep_last pruned the older copy


def test_a_damaged_folder_is_never_copied(moto_s3, monkeypatch, tmp_path):
    local, remote = LocalStore(tmp_path / "ck"), bucket_store(moto_s3, monkeypatch)
    name = checkpoint.save_checkpoint(local, state(2))
    weights = tmp_path / "ck" / name / "optimizer.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointCorrupt):
        replicate(local, remote, name)
    assert not remote.list("")


def test_copies_wait_out_an_outage_and_catch_up_in_order(monkeypatch, tmp_path):
    """The S3 endpoint answers nothing for a few seconds (no server on its port), then comes up: every
    checkpoint committed meanwhile reaches it, in order, and the source never waited for it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    endpoint = S3Endpoint(f"http://127.0.0.1:{port}", "moto-access-key", "moto-secret-key")
    for key, value in endpoint.env().items():
        monkeypatch.setenv(key, value)
    local = LocalStore(tmp_path / "ck")
    remote = S3Store("s3://replicas/run/checkpoints", endpoint.endpoint_url, max_attempts=1, connect_timeout=1)
    copies = Replicator(first_pause_s=0.2, max_pause_s=1.0)
    started = time.monotonic()
    for step in (1, 2, 3):
        copies.submit(local, remote, checkpoint.save_checkpoint(local, state(step)))
    assert time.monotonic() - started < 5 and copies.pending == 3  # committed locally at once, copies queued
    time.sleep(3)
    assert copies.failures >= 2 and copies.pending == 3 and "unreachable" in copies.last_error
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint.client().create_bucket(Bucket="replicas")
        assert copies.flush(60), copies.status()
        assert copies.copied == 3 and checkpoint.find_latest(remote).name == "global_step_000003"
        assert [checkpoint.load_checkpoint(remote, checkpoint.folder_name(s)).step for s in (1, 2, 3)] == [1, 2, 3]
    finally:
        server.stop()
