"""scripts/plot_runs.py: several run folders on one plot, each named by its config value."""

from __future__ import annotations

import json

import yaml
from PIL import Image

from scripts.plot_runs import curves, main


def fake_run(folder, seed: int, rates: list[float]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed}}))
    records = [{"step": 0, "sft_step": 5, "time": 90.0, "sft_validation_solve_rate": 0.2}]
    records += [
        {"step": 5 * i, "time": 100.0 + 60 * i, "eval_solve_rate": r, "eval_solvable_bound": 0.97}
        for i, r in enumerate(rates)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_each_run_is_a_curve_in_minutes_with_the_bound(tmp_path):
    fake_run(tmp_path / "a" / "tiny", 1, [0.5, 0.7, 0.9])
    fake_run(tmp_path / "b" / "tiny", 2, [0.4, 0.8])
    held_out, warm, bound = curves(tmp_path / "a" / "tiny")
    assert held_out == [(10 / 60, 0.5), (70 / 60, 0.7), (130 / 60, 0.9)]  # from the first record's time
    assert warm == [(0.0, 0.2)] and bound == 0.97
    out = tmp_path / "runs.png"
    assert main([str(out), str(tmp_path / "a" / "tiny"), str(tmp_path / "b" / "tiny")]) == 0
    assert Image.open(out).size == (960, 540)
