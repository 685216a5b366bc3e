"""app.observe.evaluation: what the sampled held-out play reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.observe.evaluation import sampled_report, sampled_sampling


def test_sampled_report_counts_every_sample_and_each_maze_solved_at_least_once():
    played = [
        SimpleNamespace(group=g, solved=s)
        for g, s in [(0, True), (0, False), (1, False), (1, False), (2, True), (2, True)]
    ]
    report = sampled_report(played, samples=2, temperature=0.7)
    assert report == {
        "sampled_samples": 2,
        "sampled_temperature": 0.7,
        "sampled_solve_rate": pytest.approx(3 / 6),
        "sampled_pass_at_k": pytest.approx(2 / 3),
    }
    assert sampled_report([], 2, 0.7)["sampled_solve_rate"] == 0.0


def test_sampled_play_uses_the_rollout_temperature_and_one_seed_per_held_out_set():
    from app.config import load_config

    cfg = load_config("tests/tiny.yaml", ["rollout.temperature=0.7", "eval.samples=4"])
    sampling = sampled_sampling(cfg)
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, cfg.rollout.top_p, cfg.eval.seed + 1)
    assert sampled_sampling(cfg) == sampling  # every evaluation of a run draws alike


def test_the_evaluator_starts_without_the_image_processor_or_matplotlib():
    """The head's actors are on every job's start-up path: the evaluator's module brings neither transformers'
    image processor (with torchvision) nor matplotlib, seconds of CPU each on a laptop's cores."""
    heavy = "('transformers', 'torchvision', 'matplotlib')"
    probe = f"import sys, actors.evaluator; print([m for m in {heavy} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
