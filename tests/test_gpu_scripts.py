"""The GPU experiment scripts (scripts/gpu/*.sh) run on a CPU too: the smoke runs their headers describe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)


def test_probe_sweep_runs_variants_side_by_side_and_tabulates_them(tmp_path):
    out = tmp_path / "out"
    done = run_script(["scripts/gpu/probe_sweep.sh", str(out), "1", "configs/tiny.yaml"],
                      VARIANTS_SPEC="two:eval.num_mazes=2,--steps=2 three:--steps=3,eval.num_mazes=2,maze.cell_px=8",
                      PROBE_ARGS="--device cpu --batch 2 --eval-every 1 --steps 5")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    # a variant's own --steps wins over the common one
    assert [(r["variant"], r["step"]) for r in rows] == [("three", 1), ("three", 2), ("three", 3), ("two", 1), ("two", 2)]
    table = done.stdout.split("=== perception probe")[1]
    assert "two " in table and "three " in table and "best" in table
    assert (out / "probe_logs.tar.gz").stat().st_size > 0


def test_learn_see_then_sft_starts_the_warm_start_from_the_model_that_sees(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = run_script(["scripts/gpu/learn.sh", "see+sft", str(out), str(work), "0.4"], DEVICE="cpu", SEE_EVAL_EVERY="2",
                      SEE_BATCH="2", SEE_MINUTES="0.05", EVAL_EVERY="1", SIZES="7", SFT_LRS="3e-4",
                      EXTRA="eval.num_mazes=2 sft.mazes_per_step=2 sft.variants=1 rollout.max_turns=12 "
                            "train.picture_cache_gb=0")
    assert done.returncode == 0, done.stdout + done.stderr
    log = [json.loads(line) for line in (out / "see.jsonl").read_text().splitlines()]
    assert log and all(0.0 <= e["p_exact"] <= 1.0 for e in log)
    config = json.loads((work / "seeing" / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["rope_theta"] == 10_000.0  # configs/learn_h200.yaml's model
    assert (work / "seeing" / "model.safetensors").is_file() and (work / "seeing" / "tokenizer.json").is_file()
    # the SFT stage ran from that folder, logged the why_ classes, and chose a GRPO start
    assert "SFT from " + str(work / "seeing") in done.stdout
    sft = [json.loads(line) for line in (out / "sft_s7_lr3e-4.jsonl").read_text().splitlines()]
    assert any("eval_why_first_try_open" in e for e in sft)
    choice = (work / "choice.env").read_text()
    assert "START=" in choice and f"model.path={work / 'seeing'}" not in choice  # the start is an SFT checkpoint
