"""scripts/lab/plot_learning.py: the learning curve's time axes, and the plot it writes."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.lab.plot_learning import any_curve, grpo_curve, main, sft_curve


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sft_rounds_continue_the_clock_and_a_start_step_cuts_the_warm_start(tmp_path):
    log = _write(
        tmp_path / "sft.jsonl",
        [
            {"sft_step": 10, "elapsed_s": 20.0, "eval_solve_rate": 0.1},
            {"sft_step": 20, "elapsed_s": 40.0, "eval_solve_rate": 0.3},
            {"sft_step": 10, "elapsed_s": 25.0, "eval_solve_rate": 0.5},
        ],
    )  # a second round: its clock starts at 40 s
    assert sft_curve(log) == [(20.0, 0.1), (40.0, 0.3), (65.0, 0.5)]
    assert sft_curve(log, until_step=10) == [(20.0, 0.1), (65.0, 0.5)]


def test_a_recoverys_record_keeps_the_readings_of_the_step_it_goes_back_to(tmp_path):
    grpo = _write(
        tmp_path / "grpo.jsonl",
        [
            {"step": 0, "eval_solve_rate": 0.45},
            {"step": 1, "time_step_s": 20.0, "eval_solve_rate": 0.5},
            {"step": 0, "recoveries": 1, "recovery_at": 1.0},  # app.main's record of a recovery before a checkpoint
            {"step": 1, "recoveries": 2, "recovery_at": 2.0},
        ],
    )
    assert grpo_curve(grpo) == [(0.0, 0.45), (20.0, 0.5)]


def test_a_resumed_grpo_step_counts_once_and_the_plot_is_written(tmp_path, capsys):
    grpo = _write(
        tmp_path / "grpo.jsonl",
        [
            {"step": 0, "eval_solve_rate": 0.2},
            {"step": 1, "time_step_s": 30.0},
            {"step": 2, "time_step_s": 30.0},
            {"step": 2, "time_step_s": 40.0, "eval_solve_rate": 0.4},
        ],
    )  # step 2 again after a restart: the last wins
    assert grpo_curve(grpo) == [(0.0, 0.2), (70.0, 0.4)]
    control = _write(tmp_path / "control.jsonl", [{"sft_step": 5, "elapsed_s": 50.0, "eval_solve_rate": 0.3}])
    warm = _write(
        tmp_path / "warm.jsonl",
        [
            {"sft_step": 10, "elapsed_s": 20.0, "eval_solve_rate": 0.2},
            {"sft_step": 20, "elapsed_s": 40.0, "eval_solve_rate": 0.6},
        ],
    )
    out = tmp_path / "curve.png"
    assert main([str(grpo), str(control), str(out), "--sft", f"warm={warm}", "--start-step", "10"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # earlier runs from the same checkpoint: a GRPO log and an SFT log, each read as its kind
    assert any_curve(grpo) == ("GRPO", [(0.0, 0.2), (70.0, 0.4)]) and any_curve(control) == ("SFT", [(50.0, 0.3)])
    out.unlink()
    assert main([str(grpo), str(control), str(out), "--earlier", f"a={grpo}", "--earlier", f"b={control}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the fair control (SFT of GRPO's own trainable set) beside the full-model one, on another machine's axis
    out.unlink()
    fair = _write(tmp_path / "fair.jsonl", [{"sft_step": 4, "elapsed_s": 45.0, "eval_solve_rate": 0.25}])
    assert main([str(grpo), str(control), str(out), "--fair", str(fair), "--machine", "one H100"]) == 0
    assert "fair control [(45, 0.25)]" in capsys.readouterr().out and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
