"""scripts/sft.py: the standalone warm start writes a PEFT adapter that a GRPO config can start from."""

from __future__ import annotations

import json
import os

from app import adapters
from app.config import load_config
from scripts.sft import main as sft_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def test_sft_writes_an_adapter_the_grpo_job_starts_from(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "sft"
    overrides = [f"output_dir={tmp_path}", "sft.steps=3", "sft.lr=3e-3", "sft.mazes_per_step=4", "eval.num_mazes=2"]
    assert sft_main([TINY, str(out), *overrides, "--save-every", "2"]) == 0
    log = [json.loads(line) for line in (out / "sft_log.jsonl").read_text().splitlines()]
    assert [e["sft_step"] for e in log] == [1, 2, 3]
    assert log[-1]["sft_nll"] < log[0]["sft_nll"], "demonstration NLL should fall over the warm start"
    assert log[-1]["eval_num_mazes"] == 2 and 0.0 <= log[-1]["eval_solve_rate"] <= 1.0
    assert (out / "step_2" / "adapter_model.safetensors").exists()
    cfg = load_config(TINY, [f"model.adapter_init={out / 'final'}"])  # validates that the folder exists
    tensors, _ = adapters.read_peft_folder(out / "final")
    assert any(t.abs().sum() > 0 for name, t in tensors.items() if "lora_B" in name), "the warm start changed nothing"
    assert cfg.model.adapter_init == str(out / "final")


def test_sft_with_zero_steps_is_a_config_error(tmp_path, capsys):
    assert sft_main([TINY, str(tmp_path / "x"), "sft.steps=0"]) == 2
    assert "sft.steps" in capsys.readouterr().err
