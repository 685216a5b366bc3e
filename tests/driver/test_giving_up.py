"""The driver's last word when it gives up names the checkpoint a resubmitted job goes on from, also when none of
its own attempts got its actors started (and so never read the checkpoints an earlier job left)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

import app.main as driver
from app.config import absolute_paths, load_config
from app.model.adapters import AdapterSpec
from app.storage.checkpoint import TrainingState, save_checkpoint
from app.world.sampler import MazeSampler
from placement import plan as placement


def earlier_jobs_checkpoint(root, step: int, cfg) -> None:
    lora = cfg.lora
    spec = AdapterSpec({"x.lora_A.weight": (lora.rank, 4)}, lora.rank, lora.alpha, tuple(lora.target_modules))
    config = {**spec.peft_config(), "modules_to_save": None}
    save_checkpoint(root, TrainingState(step, {"x.lora_A.weight": torch.zeros(lora.rank, 4)}, config))


def give_up(tmp_path, monkeypatch, caplog, *overrides: str) -> tuple[str, object]:
    cfg = absolute_paths(
        load_config(
            None,
            [f"output_dir={tmp_path / 'runs'}", "checkpoint.max_failures=2", "metrics.prometheus=false", *overrides],
            check_paths=False,
        )
    )
    attempts = []

    def no_actors_start(*_):  # an engine that cannot get its GPU memory, each time
        attempts.append(1)
        raise TimeoutError("start: rollout-0 did not answer")

    monkeypatch.setattr(driver, "spawn", no_actors_start)
    sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, set())
    args = argparse.Namespace(config=None, overrides=[])
    with caplog.at_level(logging.ERROR, logger="mazerl"):
        assert driver.train(cfg, placement.make_plan(cfg), sampler, args) == 1
    assert len(attempts) == 3  # the first try and checkpoint.max_failures recoveries
    (line,) = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    return line, cfg


@pytest.mark.parametrize("resume_mode", ["latest", "none"])
def test_a_job_whose_actors_never_start_names_the_checkpoint_an_earlier_job_left(
    tmp_path, monkeypatch, caplog, resume_mode
):
    ckpt = tmp_path / "ck"
    cfg = absolute_paths(load_config(None, [], check_paths=False))
    earlier_jobs_checkpoint(ckpt, 5, cfg)
    line, _ = give_up(
        tmp_path, monkeypatch, caplog, f"checkpoint.ckpt_path={ckpt}", f"checkpoint.resume_mode={resume_mode}"
    )
    assert "giving up after 2 recoveries" in line and "TimeoutError" in line
    assert "step 0" not in line, line
    if resume_mode == "latest":
        assert line.endswith(f"resumes from {ckpt / 'global_step_000005'}."), line
    else:
        assert "checkpoint.resume_mode=none none resumes" in line, line
