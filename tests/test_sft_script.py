"""scripts/sft.py: the standalone warm start writes a PEFT adapter that a GRPO config can start from."""

from __future__ import annotations

import json
import os

import pytest

from app import adapters
from app.config import load_config
from scripts.sft import main as sft_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def test_sft_writes_an_adapter_the_grpo_job_starts_from(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "sft"
    overrides = [f"output_dir={tmp_path}", "sft.steps=3", "sft.lr=3e-3", "sft.mazes_per_step=4", "eval.num_mazes=2",
                 "eval.samples=3"]
    assert sft_main([TINY, str(out), *overrides, "--save-every", "2"]) == 0
    log = [json.loads(line) for line in (out / "sft_log.jsonl").read_text().splitlines()]
    assert [e["sft_step"] for e in log] == [1, 2, 3]
    assert log[-1]["sft_nll"] < log[0]["sft_nll"], "demonstration NLL should fall over the warm start"
    assert log[-1]["eval_num_mazes"] == 2 and 0.0 <= log[-1]["eval_solve_rate"] <= 1.0
    assert log[-1]["eval_sampled_samples"] == 3 and 0.0 <= log[-1]["eval_sampled_solve_rate"] <= 1.0  # the control's too
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

    from app.model import ensure_model
    from app.training import PolicyTrainer

    out = tmp_path / "full"
    overrides = [f"output_dir={tmp_path}", "sft.steps=2", "sft.lr=1e-3", "sft.mazes_per_step=2", "eval.num_mazes=2",
                 "maze.size=7", "rollout.max_turns=9", "train.dataset_size=16", "train.picture_cache_gb=0.5"]
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
    assert trainer.lora_tensors() and trainer.codec is not None


def test_a_training_set_larger_than_the_maze_space_is_one_clear_error(tmp_path, capsys):
    assert sft_main([TINY, str(tmp_path / "x"), "maze.size=5", "train.dataset_size=500", "sft.steps=1"]) == 2
    assert "train.dataset_size" in capsys.readouterr().err


def test_perception_probe_trains_on_questions_and_scores_held_out_ones(tmp_path, tiny_model_dir, capsys):
    from scripts.perception_probe import main as probe_main

    out = tmp_path / "probe.jsonl"
    overrides = [f"output_dir={tmp_path}", "eval.num_mazes=4", "maze.size=7", "maze.cell_px=8", "rollout.max_turns=20"]
    saved = tmp_path / "seeing"
    assert probe_main([TINY, str(out), *overrides, "--steps", "3", "--batch", "4", "--eval-every", "2",
                       "--device", "cpu", "--rooms", "0.75", "--save", str(saved)]) == 0
    log = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["step"] for e in log] == [2, 3]
    assert all(0.0 <= e["p_exact"] <= 1.0 and 0.0 <= e["answered"] <= 1.0 and e["heldout_nll"] > 0 for e in log)
    for e in log:  # the score split by where the agent stands; the held-out questions have both kinds or one
        parts = [p for p in (e["p_exact_room"], e["p_exact_passage"]) if p is not None]
        assert parts and min(parts) <= e["p_exact"] + 1e-9 and e["p_exact"] <= max(parts) + 1e-9
    assert probe_main([TINY, str(out), "sft.noise=2"]) == 2  # a bad config is one clear error
    # --stop-above ends at the first evaluation past it (any p > 1e-30); flags may sit between the overrides
    again = tmp_path / "again.jsonl"
    assert probe_main([TINY, str(again), overrides[0], "--stop-above", "1e-30", *overrides[1:], "--steps", "9",
                       "--batch", "2", "--eval-every", "1", "--device", "cpu"]) == 0
    assert [json.loads(line)["step"] for line in again.read_text().splitlines()] == [1]

    # The saved model is a model folder that the diagnosis (and scripts/sft.py, model.path=) plays
    from scripts.diagnose import main as diagnose_main

    assert diagnose_main([TINY, str(saved), *overrides[:4], "rollout.max_turns=9", "--questions", "--device", "cpu"]) == 0
    played = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert played["mazes"] == 4 and played["questions"] == 4 and 0 <= played["open_moves_per_neighbour"] <= 1
    assert played["turns"] <= 36 and sum(v for k, v in played.items() if k.startswith("share_")) == pytest.approx(1)


def test_the_probe_asks_in_rooms_or_passages_as_told(tmp_path, capsys):
    import numpy as np

    from app.maze import generate_maze, is_room
    from scripts.perception_probe import cell_to_ask, main as probe_main

    mazes = [generate_maze(seed, 7) for seed in range(50)]
    rng = np.random.default_rng(0)
    assert all(is_room(cell_to_ask(m, rng, 1.0)) for m in mazes)
    assert not any(is_room(cell_to_ask(m, rng, 0.0)) for m in mazes)
    half = [is_room(cell_to_ask(m, rng, 0.5)) for m in mazes * 8]
    assert 0.4 < np.mean(half) < 0.6
    # without --rooms every open cell is alike: the draws of the runs before the option existed
    plain, before = np.random.default_rng(3), np.random.default_rng(3)
    for m in mazes:
        cells = m.open_cells()
        assert cell_to_ask(m, plain) == tuple(cells[before.integers(len(cells))])
    assert probe_main([TINY, str(tmp_path / "p.jsonl"), "--rooms", "1.5"]) == 2
    assert "--rooms must be a share between 0 and 1" in capsys.readouterr().err


def test_diagnose_reads_an_eval_report_and_rejects_bad_usage(tmp_path, capsys):
    from app.dialogue import format_action
    from app.maze import Action, generate_maze
    from scripts.diagnose import main as diagnose_main

    maze = generate_maze(11, 7)
    solved = [format_action(Action.move(d)) for d in maze.shortest_path()] + [format_action(Action.stop())]
    report = tmp_path / "eval_step_000004.json"
    report.write_text(json.dumps({"mazes": [{"seed": 11, "maze_id": maze.identity, "actions": solved},
                                            {"seed": 12, "actions": [None, None]}]}))
    assert diagnose_main([TINY, "--eval-json", str(report), "maze.size=7"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["solved"] == 1 and found["share_invalid"] == pytest.approx(2 / (len(solved) + 2))
    assert found["first_try_toward"] == 1.0
    assert diagnose_main([TINY]) == 2 and "either MODEL_DIR" in capsys.readouterr().err
    assert diagnose_main([TINY, "--eval-json", str(report), "maze.size=4"]) == 2  # a bad override: one clear error
    assert diagnose_main([TINY, "--eval-json", str(report), "maze.size=9", "rollout.max_turns=20"]) == 2  # not its size
    assert "is not the maze the report played" in capsys.readouterr().err
    assert diagnose_main([TINY, "--eval-json", str(tmp_path / "missing.json")]) == 2
