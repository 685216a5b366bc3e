"""The command line: --plan (and --cluster) wherever they come among the overrides."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from app.main import parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_plan_may_come_before_between_or_after_the_overrides():
    for argv in (
        ["c.yaml", "--plan", "train.lr=1e-4", "eval.num_mazes=4"],
        ["c.yaml", "train.lr=1e-4", "--plan", "eval.num_mazes=4"],
        ["--plan", "c.yaml", "train.lr=1e-4", "eval.num_mazes=4"],
        ["c.yaml", "train.lr=1e-4", "eval.num_mazes=4", "--plan"],
    ):
        args = parse_args(argv)
        assert args.plan and args.config == "c.yaml" and args.overrides == ["train.lr=1e-4", "eval.num_mazes=4"], argv


def test_plan_then_an_override_prints_the_overridden_config_and_starts_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "app.main", "tests/tiny.yaml", "--plan", "train.lr=1.5e-4", f"output_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lr: 0.00015" in done.stdout and "placement group:" in done.stdout
    assert not any(tmp_path.iterdir())  # nothing made: no run folder, no model built
