"""A run that would resume a checkpoint whose adapter is not the one `lora.*` describes (the rank, the scale, the
targets, or whether the vision tower trains changed since) is one ConfigError naming the field, before Ray or any
actor starts; a matching checkpoint, or none, passes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.config import ConfigError, LoraSettings, absolute_paths, load_config
from app.driver.preflight import check_resume
from app.model.adapters import AdapterSpec
from app.storage.checkpoint import MANIFEST, TrainingState, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def save(root: Path, step: int, lora: LoraSettings) -> None:
    """A checkpoint whose adapter_config.json is what a run with `lora` writes (the tensors do not matter here)."""
    spec = AdapterSpec({"x.lora_A.weight": (lora.rank, 4)}, lora.rank, lora.alpha, tuple(lora.target_modules))
    config = {**spec.peft_config(), "modules_to_save": list(lora.modules_to_save) or None}
    save_checkpoint(root, TrainingState(step, {"x.lora_A.weight": torch.zeros(lora.rank, 4)}, config))


def config(ckpt: Path, *overrides: str):
    return absolute_paths(load_config(None, [f"checkpoint.ckpt_path={ckpt}", *overrides], check_paths=False))


def test_a_checkpoint_of_the_same_adapter_or_none_passes(tmp_path):
    assert check_resume(config(tmp_path / "empty")) is None
    save(tmp_path / "ck", 3, LoraSettings())
    assert check_resume(config(tmp_path / "ck")).endswith("global_step_000003")
    assert check_resume(config(tmp_path / "ck", "lora.rank=16", "checkpoint.resume_mode=none")) is None


@pytest.mark.parametrize(
    "saved, overrides, field",
    [
        (LoraSettings(rank=16, alpha=32), [], "lora.rank"),  # the defaults: rank 32, alpha 64
        (LoraSettings(alpha=8), [], "lora.alpha"),
        (LoraSettings(target_modules=["q_proj", "v_proj"]), [], "lora.target_modules"),
        (LoraSettings(modules_to_save=["visual"]), [], "lora.modules_to_save"),
        (LoraSettings(), ["lora.modules_to_save=[visual]"], "lora.modules_to_save"),
    ],
)
def test_a_checkpoint_of_another_adapter_is_refused_naming_the_field(tmp_path, saved, overrides, field):
    save(tmp_path / "ck", 2, saved)
    with pytest.raises(ConfigError) as raised:
        check_resume(config(tmp_path / "ck", *overrides))
    assert raised.value.field_path == field
    assert "global_step_000002" in raised.value.problem and "resume_mode=none" in raised.value.fix


def test_the_checkpoint_checked_is_the_one_the_resume_loads(tmp_path):
    """resume_mode path names its folder; with latest, a newest folder whose adapter config does not match its
    manifest is skipped, as the resume skips it."""
    save(tmp_path / "ck", 1, LoraSettings())
    save(tmp_path / "ck", 2, LoraSettings(rank=16, alpha=32))
    path = f"checkpoint.resume_path={tmp_path / 'ck' / 'global_step_000001'}"
    assert check_resume(config(tmp_path / "other", "checkpoint.resume_mode=path", path)).endswith("000001")
    with pytest.raises(ConfigError, match="lora.rank"):
        check_resume(config(tmp_path / "other", "checkpoint.resume_mode=path", f"checkpoint.resume_path={tmp_path}/ck"))
    newest = tmp_path / "ck" / "global_step_000002" / "adapter_config.json"
    newest.write_text(newest.read_text().replace('"r": 16', '"r": 8'))  # no longer what the manifest lists
    manifest = json.loads((newest.parent / MANIFEST).read_text())
    assert manifest["files"]["adapter_config.json"]["sha256"] != hashlib.sha256(newest.read_bytes()).hexdigest()
    assert check_resume(config(tmp_path / "ck")).endswith("global_step_000001")


def test_the_job_stops_with_the_field_before_ray_starts(tmp_path):
    save(tmp_path / "ck", 4, LoraSettings(rank=8, alpha=16, modules_to_save=["visual"]))  # tiny.yaml's, + tower
    done = subprocess.run(
        [sys.executable, "-m", "app.main", "configs/tiny.yaml", f"checkpoint.ckpt_path={tmp_path / 'ck'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "RAY_ADDRESS": "127.0.0.1:1", "HOME": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("mazerl: ")]
    assert len(errors) == 1 and "'lora.modules_to_save'" in errors[0] and "global_step_000004" in errors[0]
