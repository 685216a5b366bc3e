"""Checkpoints: full round trips, atomic commits that survive a SIGKILL, corruption detected by checksum
and skipped, pruning, resume modes, and the streaming safetensors writer. Nothing stored is a pickle."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from app.model.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from app.storage import safetensors_stream
from app.storage.checkpoint import (
    CheckpointCorrupt,
    TrainingState,
    export_adapter,
    find_latest,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from app.storage.local import LocalStore
from app.storage.rng import capture_rng, restore_rng
from app.storage.s3 import S3Store
from app.storage.safetensors_stream import stream_save_safetensors
from app.storage.store import StorageUnavailable, Store

REPO = Path(__file__).resolve().parents[2]
LAYER = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
PEFT_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "lora_dropout": 0.0}


def training_state(step: int, seed: int = 0) -> TrainingState:
    g = torch.Generator().manual_seed(seed + step)
    rng_tensors, rng_json = capture_rng()
    return TrainingState(
        step=step,
        adapter={
            f"{LAYER}.lora_A.weight": torch.randn(4, 16, generator=g, dtype=torch.float32).to(torch.bfloat16),
            f"{LAYER}.lora_B.weight": torch.randn(16, 4, generator=g),
        },
        adapter_config=dict(PEFT_CONFIG),
        optimizer={
            "state.0.exp_avg": torch.randn(4, 16, generator=g),
            "state.0.step": torch.tensor(float(step)),
            "state.1.exp_avg_sq": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        },
        rng_tensors=rng_tensors,
        state={
            "scheduler": {"last_epoch": step, "lrs": [1e-5]},
            "sampler": {"epoch": 1, "position": 7 * step},
            "rng": rng_json,
            "config": {"train": {"lr": 1e-5}},
            "metrics": [{"step": s, "solve_rate": 0.5} for s in range(step)],
            "extra": None,
        },
    )


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def assert_same_state(a: TrainingState, b: TrainingState) -> None:
    assert a.step == b.step and a.adapter_config == b.adapter_config and a.state == b.state
    for field in ("adapter", "optimizer", "rng_tensors"):
        assert_same_tensors(getattr(a, field), getattr(b, field))


def s3_store(endpoint, monkeypatch) -> S3Store:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in endpoint.env().items():
        monkeypatch.setenv(name, value)
    return S3Store(f"s3://{endpoint.new_bucket()}/run/checkpoints", endpoint_url=endpoint.endpoint_url)


@pytest.fixture(params=["local", "moto", pytest.param("ceph", marks=pytest.mark.s3)])
def store(request, tmp_path, monkeypatch) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "checkpoints")
    return s3_store(request.getfixturevalue(f"{request.param}_s3"), monkeypatch)


@pytest.fixture(params=["moto", pytest.param("ceph", marks=pytest.mark.s3)])
def s3_only(request, monkeypatch) -> S3Store:
    return s3_store(request.getfixturevalue(f"{request.param}_s3"), monkeypatch)


def corrupt(store: Store, key: str, change) -> None:
    store.put_bytes(key, change(store.get_bytes(key)))


# ---------------------------------------------------------------- round trip and layout


def test_round_trip_of_every_field(store):
    ts = training_state(3)
    assert save_checkpoint(store, ts) == "global_step_000003"
    assert sorted(store.list("global_step_000003/")) == [
        f"global_step_000003/{f}"
        for f in sorted(
            ["MANIFEST.json", ADAPTER_WEIGHTS, ADAPTER_CONFIG, "optimizer.safetensors", "rng.safetensors", "state.json"]
        )
    ]
    assert store.get_bytes("latest") == b"global_step_000003"
    config = json.loads(store.get_bytes(f"global_step_000003/{ADAPTER_CONFIG}"))
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["q_proj"]
    manifest = json.loads(store.get_bytes("global_step_000003/MANIFEST.json"))
    assert manifest["format"] == 1 and manifest["step"] == 3 and len(manifest["files"]) == 5
    assert_same_state(load_checkpoint(store), ts)
    info = find_latest(store)
    assert (info.name, info.step, info.kind) == ("global_step_000003", 3, "checkpoint")
    assert info.location == store.uri("global_step_000003")


def test_accepts_a_plain_path(tmp_path):
    ts = training_state(1)
    save_checkpoint(str(tmp_path / "ck"), ts)
    assert_same_state(load_checkpoint(str(tmp_path / "ck"), "global_step_000001"), ts)
    assert load_file(str(tmp_path / "ck" / "global_step_000001" / ADAPTER_WEIGHTS)).keys() == ts.adapter.keys()


def test_rng_states_round_trip(tmp_path):
    import random

    import numpy as np

    ts = training_state(1)
    save_checkpoint(tmp_path, ts)
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    loaded = load_checkpoint(tmp_path)
    restore_rng(loaded.rng_tensors, loaded.state["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.array_equal(np.random.rand(2), expected[2])


def test_state_must_be_json(tmp_path):
    ts = training_state(1)
    ts.state["bad"] = torch.zeros(1)
    with pytest.raises(TypeError, match="plain JSON"):
        save_checkpoint(tmp_path, ts)
    assert find_latest(tmp_path) is None and not any(tmp_path.iterdir())


def test_saving_the_same_step_again_replaces_it(store):
    save_checkpoint(store, training_state(2, seed=0))
    second = training_state(2, seed=1)
    save_checkpoint(store, second)
    assert_same_state(load_checkpoint(store), second)
    assert not any(".tmp-" in key for key in store.list())


# ---------------------------------------------------------------- interrupted writes

SLOW_SAVE = """
import sys, time, torch
import app.storage.checkpoint as ck, app.storage.safetensors_stream as stream
write = stream._write_tensor
def slow_write(f, tensor):  # one tensor every 20 ms: the parent kills us in the middle
    time.sleep(0.02)
    write(f, tensor)
stream._write_tensor = slow_write
adapter = {"base_model.model.x.lora_A.weight": torch.ones(4, 8)}
optimizer = {f"state.{i}.exp_avg": torch.full((1000,), float(i)) for i in range(2000)}
ck.save_checkpoint(sys.argv[1], ck.TrainingState(2, adapter, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
                                                 optimizer, {}, {}))
"""

HANG_BEFORE_MARKER = """
import sys, time, torch
import app.storage.checkpoint as ck, app.storage.local as storage
put = storage.LocalStore.put_bytes
def put_bytes(self, key, data):
    if key == "latest":
        print("folder committed", flush=True)
        time.sleep(600)
    put(self, key, data)
storage.LocalStore.put_bytes = put_bytes
adapter = {"base_model.model.x.lora_A.weight": torch.ones(4, 8)}
ck.save_checkpoint(sys.argv[1], ck.TrainingState(2, adapter, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
"""


def spawn(code: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the writer finished before it could be killed"
        assert time.monotonic() < deadline, "the writer never reached the point to kill it at"
        time.sleep(0.02)


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path, caplog):
    root = tmp_path / "ck"
    first = training_state(1)
    save_checkpoint(root, first)
    proc = spawn(SLOW_SAVE, root)
    wait_for(lambda: any((p / "optimizer.safetensors").exists() for p in root.glob(".tmp-global_step_000002-*")), proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(root.glob(".tmp-global_step_000002-*")), "the temp folder should be left behind"
    assert (root / "latest").read_text() == "global_step_000001"
    with caplog.at_level(logging.WARNING):
        assert find_latest(root).step == 1
    assert "unfinished write" in caplog.text
    assert_same_state(load_checkpoint(root), first)
    save_checkpoint(root, training_state(3))  # the next save cleans up
    assert sorted(p.name for p in root.iterdir()) == ["global_step_000001", "global_step_000003", "latest"]


def test_sigkill_before_the_marker_keeps_latest_on_the_previous(tmp_path):
    root = tmp_path / "ck"
    save_checkpoint(root, training_state(1))
    proc = spawn(HANG_BEFORE_MARKER, root)
    assert proc.stdout.readline().strip() == "folder committed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (root / "global_step_000002" / "MANIFEST.json").exists()
    assert find_latest(root).step == 1  # the marker is the commit point
    retry = training_state(2, seed=5)
    save_checkpoint(root, retry)  # a retry of step 2 replaces the folder
    assert find_latest(root).step == 2
    assert_same_state(load_checkpoint(root), retry)


def test_s3_commit_interrupted_before_the_manifest(s3_only, caplog):
    store = s3_only
    save_checkpoint(store, training_state(1))
    put_file = store.put_file

    def fail_on_manifest(key, path):
        if key.endswith("MANIFEST.json"):
            raise ConnectionError("network gone")
        put_file(key, path)

    store.put_file = fail_on_manifest
    with pytest.raises(ConnectionError):
        save_checkpoint(store, training_state(2))
    del store.put_file
    assert store.exists("global_step_000002/optimizer.safetensors")  # objects uploaded, the manifest not
    with caplog.at_level(logging.WARNING, logger="app.storage.checkpoint"):
        assert find_latest(store).step == 1
    assert "global_step_000002" in caplog.text and "not committed" in caplog.text
    assert store.get_bytes("latest") == b"global_step_000001"
    save_checkpoint(store, training_state(3))  # cleans the leftover up
    assert [k for k in store.list() if k.startswith("global_step_000002")] == []


# ---------------------------------------------------------------- corruption


def flip_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


CORRUPTIONS = {
    "flipped byte": ("optimizer.safetensors", flip_byte, "checksum"),
    "truncated file": ("rng.safetensors", lambda d: d[: len(d) // 2], "truncated"),
    "garbage manifest": ("MANIFEST.json", lambda d: b"{not json", "unparsable"),
    "manifest of another step": ("MANIFEST.json", lambda d: d.replace(b'"step": 2', b'"step": 7'), "unparsable"),
}


def on_backends(cases: list[str]) -> list:
    """Every case on the local store; the first also on moto and Ceph (the checks do not depend on the
    backend beyond reading bytes, and every S3 request costs time)."""
    return [("local", c) for c in cases] + [("moto", cases[0]), pytest.param("ceph", cases[0], marks=pytest.mark.s3)]


@pytest.mark.parametrize("store, case", on_backends(list(CORRUPTIONS)), indirect=["store"])
def test_corrupt_newest_is_skipped_with_a_clear_message(store, caplog, case):
    fname, change, words = CORRUPTIONS[case]
    older = training_state(1)
    save_checkpoint(store, older)
    save_checkpoint(store, training_state(2))
    corrupt(store, f"global_step_000002/{fname}", change)
    with caplog.at_level(logging.WARNING, logger="app.storage.checkpoint"):
        assert find_latest(store).step == 1
    assert "global_step_000002" in caplog.text and words in caplog.text
    assert_same_state(load_checkpoint(store), older)
    with pytest.raises(CheckpointCorrupt, match=words):
        load_checkpoint(store, "global_step_000002")


@pytest.mark.parametrize("store, missing", on_backends(["MANIFEST.json", "optimizer.safetensors"]), indirect=["store"])
def test_missing_files(store, caplog, missing):
    save_checkpoint(store, training_state(1))
    save_checkpoint(store, training_state(2))
    store.delete_prefix(f"global_step_000002/{missing}")
    with caplog.at_level(logging.WARNING, logger="app.storage.checkpoint"):
        assert find_latest(store).step == 1
    assert "global_step_000002" in caplog.text
    assert ("no MANIFEST.json" if missing == "MANIFEST.json" else "optimizer.safetensors is missing") in caplog.text


def test_marker_pointing_to_a_missing_folder(store, caplog):
    save_checkpoint(store, training_state(1))
    save_checkpoint(store, training_state(2))
    store.put_bytes("latest", b"global_step_000009")
    with caplog.at_level(logging.WARNING, logger="app.storage.checkpoint"):
        assert find_latest(store).step == 2
    assert "global_step_000009" in caplog.text


def test_nothing_complete_means_none(store):
    assert find_latest(store) is None
    save_checkpoint(store, training_state(1))
    corrupt(store, "global_step_000001/state.json", flip_byte)
    assert find_latest(store) is None
    with pytest.raises(FileNotFoundError):
        load_checkpoint(store)


# ---------------------------------------------------------------- pruning, resume, export


def test_keep_last_prunes_older_complete_checkpoints(store):
    for step in (10, 20, 30, 40):
        save_checkpoint(store, training_state(step), keep_last=2)
    folders = sorted({k.split("/")[0] for k in store.list() if k.startswith("global_step_")})
    assert folders == ["global_step_000030", "global_step_000040"]
    # resumed from an older checkpoint: newer folders are left alone, the one just written is kept
    save_checkpoint(store, training_state(35), keep_last=1)
    folders = sorted({k.split("/")[0] for k in store.list() if k.startswith("global_step_")})
    assert folders == ["global_step_000035", "global_step_000040"]
    assert find_latest(store).step == 35


def test_resolve_resume_modes(tmp_path, caplog):
    root = tmp_path / "ck"
    caplog.set_level(logging.INFO, logger="app.storage.checkpoint")
    assert resolve_resume("none", str(root), None) is None
    assert "starting from scratch" in caplog.text
    assert resolve_resume("latest", str(root), None) is None
    assert "no complete checkpoint" in caplog.text
    save_checkpoint(root, training_state(1))
    save_checkpoint(root, training_state(2))
    assert resolve_resume("latest", str(root), None).step == 2
    assert "global_step_000002" in caplog.records[-1].getMessage()
    assert resolve_resume("path", "ignored", str(root / "global_step_000001")).step == 1
    assert resolve_resume("path", "ignored", str(root)).step == 2
    with pytest.raises(FileNotFoundError):
        resolve_resume("path", "ignored", str(tmp_path / "empty"))
    corrupt(LocalStore(root), "global_step_000001/adapter_model.safetensors", flip_byte)
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        resolve_resume("path", "ignored", str(root / "global_step_000001"))
    with pytest.raises(ValueError):
        resolve_resume("newest", str(root), None)


def test_resume_from_unreachable_s3_is_an_error_not_a_fresh_start(moto_s3, monkeypatch):
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StorageUnavailable, match="missing"):
        resolve_resume("latest", S3Store("s3://mazerl-typo-bucket/ck", endpoint_url=moto_s3.endpoint_url), None)


def test_export_adapter(store):
    ts = training_state(5)
    assert export_adapter(store, 5, ts.adapter, ts.adapter_config) == "global_step_000005"
    assert store.list("global_step_000005/") == sorted(
        f"global_step_000005/{f}" for f in (ADAPTER_CONFIG, "MANIFEST.json", ADAPTER_WEIGHTS)
    )
    info = find_latest(store)
    assert (info.step, info.kind) == (5, "adapter")
    with pytest.raises(CheckpointCorrupt, match="not a full training checkpoint"):
        load_checkpoint(store, "global_step_000005")
    with pytest.raises(ValueError, match="lora_alpha"):
        export_adapter(store, 6, ts.adapter, {"r": 4, "target_modules": ["q_proj"]})


def test_adapter_names_are_normalized_to_peft_names(tmp_path):
    ts = training_state(1)
    ts.adapter = {"model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 16)}
    save_checkpoint(tmp_path, ts)
    assert list(load_checkpoint(tmp_path).adapter) == [f"{LAYER}.lora_A.weight"]


# ---------------------------------------------------------------- no pickles


def test_nothing_stored_is_a_pickle_and_load_never_unpickles(store, monkeypatch):
    save_checkpoint(store, training_state(1))
    export_adapter(store, 2, training_state(2).adapter, PEFT_CONFIG)
    save_checkpoint(store, training_state(3))
    for key in store.list():
        head = store.get_bytes(key)[:2]
        assert head not in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"), key
        assert not head.startswith(b"PK"), key  # torch.save's zip container

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling from storage")

    for target, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    assert load_checkpoint(store).step == 3 and find_latest(store).step == 3


# ---------------------------------------------------------------- the streaming writer


def test_stream_save_matches_safetensors(tmp_path):
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.randn(2, 2),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    stream_save_safetensors(tmp_path / "a.safetensors", tensors, metadata={"format": "pt"})
    assert_same_tensors(load_file(str(tmp_path / "a.safetensors")), {k: v.contiguous() for k, v in tensors.items()})
    stream_save_safetensors(tmp_path / "b.safetensors", iter(tensors.items()))
    assert_same_tensors(load_file(str(tmp_path / "b.safetensors")), tensors)
    stream_save_safetensors(tmp_path / "empty.safetensors", {})
    assert load_file(str(tmp_path / "empty.safetensors")) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "empty.safetensors"]
    with pytest.raises(ValueError):
        stream_save_safetensors(tmp_path / "c.safetensors", [("x", torch.zeros(1)), ("x", torch.zeros(1))])


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


@st.composite
def tensor_dicts(draw) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text("abcxyz._0123", min_size=1, max_size=12), max_size=6, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))  # any bit pattern, NaNs included
        out[name] = (torch.frombuffer(bytearray(raw), dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)).reshape(
            shape
        )
    return out


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_dicts(), as_iterable=st.booleans())
def test_stream_save_round_trips_any_tensors(tensors, as_iterable):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        stream_save_safetensors(path, iter(tensors.items()) if as_iterable else tensors)
        assert_same_tensors(load_file(str(path)), tensors)


def test_tensors_are_written_one_by_one(tmp_path, monkeypatch):
    # the writer must hand each tensor to the file as it goes, never join them into one buffer
    sizes = []
    real = safetensors_stream._write_tensor
    monkeypatch.setattr(safetensors_stream, "_write_tensor", lambda f, t: (sizes.append(f.tell()), real(f, t)))
    stream_save_safetensors(tmp_path / "x.safetensors", {f"t{i}": torch.zeros(1000) for i in range(5)})
    assert sizes == sorted(sizes) and sizes[-1] - sizes[0] == 4 * 4000
