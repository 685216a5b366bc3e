"""scripts/sft.py: the standalone warm start writes a PEFT adapter that a GRPO config can start from."""

from __future__ import annotations

import json
import os

import pytest

from app.config import load_config
from app.model import adapters
from scripts.sft import main as sft_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "tests", "tiny.yaml")


def test_sft_writes_an_adapter_the_grpo_job_starts_from(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "sft"
    overrides = [
        f"output_dir={tmp_path}",
        "sft.steps=3",
        "sft.lr=3e-3",
        "sft.mazes_per_step=4",
        "eval.num_mazes=2",
        "eval.samples=3",
    ]
    assert sft_main([TINY, str(out), *overrides, "--save-every", "2"]) == 0
    log = [json.loads(line) for line in (out / "sft_log.jsonl").read_text().splitlines()]
    assert [e["sft_step"] for e in log] == [1, 2, 3]
    assert log[-1]["sft_nll"] < log[0]["sft_nll"], "demonstration NLL should fall over the warm start"
    assert log[-1]["eval_num_mazes"] == 2 and 0.0 <= log[-1]["eval_solve_rate"] <= 1.0
    assert (
        log[-1]["eval_sampled_samples"] == 3 and 0.0 <= log[-1]["eval_sampled_solve_rate"] <= 1.0
    )  # the control's too
    assert (out / "step_2" / "adapter_model.safetensors").exists()
    cfg = load_config(TINY, [f"model.adapter_init={out / 'final'}"])  # validates that the folder exists
    tensors, _ = adapters.read_peft_folder(out / "final")
    assert any(t.abs().sum() > 0 for name, t in tensors.items() if "lora_B" in name), "the warm start changed nothing"
    assert cfg.model.adapter_init == str(out / "final")


def test_sft_with_zero_steps_is_a_config_error(tmp_path, capsys):
    assert sft_main([TINY, str(tmp_path / "x"), "sft.steps=0"]) == 2
    assert "sft.steps" in capsys.readouterr().err


def test_full_model_sft_writes_model_folders_that_start_a_run(tmp_path, capsys):
    """--full trains every weight (vision tower included) and saves model folders for `model.path`."""
    import torch
    from safetensors.torch import load_file

    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model

    out = tmp_path / "full"
    overrides = [
        f"output_dir={tmp_path}",
        "sft.steps=2",
        "sft.lr=1e-3",
        "sft.mazes_per_step=2",
        "eval.num_mazes=2",
        "maze.size=7",
        "rollout.max_turns=9",
        "train.dataset_size=16",
        "train.picture_cache_gb=0.5",
    ]
    assert sft_main([TINY, str(out), *overrides, "--full", "--eval-every", "1", "--save-dtype", "float32"]) == 0
    log = [json.loads(line) for line in (out / "sft_log.jsonl").read_text().splitlines()]
    assert [e["sft_step"] for e in log] == [1, 2] and all("eval_solve_rate" in e for e in log)
    assert (out / "step_1" / "model.safetensors").exists() and not (out / "step_1.partial").exists()
    cfg = load_config(TINY, [*overrides, f"model.path={out / 'final'}"])
    base = load_file(str(ensure_model(load_config(TINY, overrides).model, tmp_path / ".models") / "model.safetensors"))
    trained = load_file(str(out / "final" / "model.safetensors"))
    assert set(trained) == set(base)  # the LoRA was merged away: a plain model folder
    changed = {name for name in base if not torch.equal(base[name], trained[name])}
    assert any("visual" in name for name in changed) and any("language_model" in name for name in changed)
    trainer = PolicyTrainer(cfg, cfg.model.path)  # GRPO starts from it, with a fresh LoRA on top
    assert trainer.trained_tensors() and trainer.codec is not None


def test_a_training_set_larger_than_the_maze_space_is_one_clear_error(tmp_path, capsys):
    assert sft_main([TINY, str(tmp_path / "x"), "maze.size=5", "train.dataset_size=500", "sft.steps=1"]) == 2
    assert "train.dataset_size" in capsys.readouterr().err


def test_diagnose_reads_an_eval_report_and_rejects_bad_usage(tmp_path, capsys):
    from app.world.dialogue import format_action
    from app.world.maze import Action, generate_maze
    from scripts.diagnose import main as diagnose_main

    maze = generate_maze(11, 7)
    solved = [format_action(Action.move(d)) for d in maze.shortest_path()] + [format_action(Action.stop())]
    report = tmp_path / "eval_step_000004.json"
    report.write_text(
        json.dumps(
            {
                "mazes": [
                    {"seed": 11, "maze_id": maze.identity, "actions": solved},
                    {"seed": 12, "actions": [None, None]},
                ]
            }
        )
    )
    assert diagnose_main([TINY, "--eval-json", str(report), "maze.size=7"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["solved"] == 1 and found["share_invalid"] == pytest.approx(2 / (len(solved) + 2))
    assert found["first_try_toward"] == 1.0
    assert diagnose_main([TINY]) == 2 and "either MODEL_DIR" in capsys.readouterr().err
    assert diagnose_main([TINY, "--eval-json", str(report), "maze.size=4"]) == 2  # a bad override: one clear error
    assert diagnose_main([TINY, "--eval-json", str(report), "maze.size=9", "rollout.max_turns=20"]) == 2  # not its size
    assert "is not the maze the report played" in capsys.readouterr().err
    assert diagnose_main([TINY, "--eval-json", str(tmp_path / "missing.json")]) == 2
