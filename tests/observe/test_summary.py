"""The summary a person reads at the end of a run, from a synthetic run folder."""

from __future__ import annotations

import json
import sys

from app.observe.summary import build_summary, where_the_time_went


def write_run(run_dir, t0: float) -> None:
    records = [
        {"step": 0, "time": t0 + 20, "sft_step": 1, "sft_step_s": 1.0, "sft_nll": 2.0},
        {"step": 0, "time": t0 + 50, "sft_step": 30, "sft_step_s": 1.0, "sft_validation_solve_rate": 0.5},
        {"step": 0, "time": t0 + 56, "eval_solve_rate": 0.5, "eval_solvable_bound": 0.95, "eval_num_mazes": 64},
    ]
    for step in (1, 2):
        records.append(
            {
                "step": step,
                "time": t0 + 56 + 30 * step,
                "train_loss": 0.1,
                "time_rollout_s": 20.0,
                "time_train_s": 9.0,
                "time_sync_s": 0.5,
                "time_checkpoint_s": 0.5,
                "time_step_s": 30.0,
            }
        )
    records[-1].update(eval_solve_rate=0.75, eval_solvable_bound=0.95, eval_num_mazes=64, time_eval_s=4.0)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (run_dir / "export" / "global_step_000002").mkdir(parents=True)
    (run_dir / "report.html").write_text("<html></html>")


def test_the_summary_says_what_was_learned_where_the_time_went_and_what_next(tmp_path):
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    write_run(run_dir, 1000.0)
    text = build_summary(run_dir, 1000.0, 1130.0, "configs/tiny.yaml", ["train.seed=3"], "tiny", "http://h:8265")
    assert "2 GRPO steps in 2 min 10 s" in text
    assert "before GRPO (step 0): 50.0%" in text and "after GRPO (step 2):  75.0% (+25.0 points)" in text
    assert "the bound (mazes solvable within the turn budget): 95.0%" in text
    assert "report               " + str(run_dir / "report.html") in text
    assert "exported adapter     " + str(run_dir / "export" / "global_step_000002") in text
    python = sys.executable  # by its full path: the commands work from a shell without the venv activated
    assert f"{python} -m app.serve --model tiny --adapters {run_dir / 'export'}" in text
    assert f"{python} scripts/play.py --model global_step_000002" in text
    assert (
        f"job submit --address http://h:8265 --working-dir . -- {python} -m app.main configs/tiny.yaml train.seed=3"
        in text
    )
    assert f"{python} -m app.main configs/tiny.yaml train.seed=3 train.max_steps=4" in text


def test_a_run_that_trained_every_weight_is_merged_and_served_as_the_model(tmp_path):
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    write_run(run_dir, 1000.0)
    export = run_dir / "export" / "global_step_000002"
    (export / "adapter_config.json").write_text(json.dumps({"modules_to_save": ["visual", "language_model"]}))
    text = build_summary(run_dir, 1000.0, 1130.0, "configs/tiny.yaml", [], "tiny", None)
    merged = run_dir / "model_global_step_000002"
    assert f"{sys.executable} scripts/merge_adapter.py {export} {merged}" in text
    assert f"-m app.serve --model {merged}\n" in text and "scripts/play.py --model base" in text


def test_where_the_time_went_adds_up_to_the_wall_time(tmp_path):
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    write_run(run_dir, 1000.0)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    parts = dict(where_the_time_went(records, 1000.0, 1130.0))
    assert parts["start-up: Ray, the actors, the engines, the model"] == 19.0
    assert parts["warm start (SFT and its validation)"] == 31.0
    assert parts["steps: rollout"] == 40.0 and parts["steps: eval"] == 4.0
    assert abs(sum(parts.values()) - 130.0) < 1e-6
