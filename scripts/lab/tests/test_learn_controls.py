"""learn.sh's controls: the full-model control, the fair one that trains GRPO's own set, or both side by side."""

from __future__ import annotations

import json
import shutil

from lab_shell import SMOKE, run_script, tar_names


def test_learn_pack_takes_each_running_controls_newest_save_when_it_has_no_final_model(tmp_path):
    work = tmp_path / "work"
    folders = ["start", "control_1/final", "control_2/step_3", "control_2/step_12", "control_2/step_9"]
    for folder in [*folders, "control_same_1/step_4", "control_same_1/step_20"]:
        (work / folder).mkdir(parents=True)
        (work / folder / "model.safetensors").write_text(folder)
    for control in ("control_1", "control_2", "control_same_1"):
        (work / control / "sft_log.jsonl").write_text("{}\n")
    (work / "choice.env").write_text('START="start"\n')
    packed = run_script(["scripts/lab/learn.sh", "pack", str(tmp_path / "pieces"), str(work)])
    assert packed.returncode == 0, packed.stdout + packed.stderr
    names = tar_names(sorted((tmp_path / "pieces").glob("state.tar.*")))
    assert "control_2/step_12/model.safetensors" in names and "start/model.safetensors" in names
    assert not any(n.startswith(("control_1/final", "control_2/step_3", "control_2/step_9")) for n in names)
    # the fair control's rounds are its own: its newest save and its log go, its older save does not
    assert "control_same_1/step_20/model.safetensors" in names and "control_same_1/sft_log.jsonl" in names
    assert not any(n.startswith("control_same_1/step_4") for n in names)
    (work / "control_2" / "final").mkdir()  # once the control has ended, its final model
    (work / "control_2" / "final" / "model.safetensors").write_text("final")
    assert run_script(["scripts/lab/learn.sh", "pack", str(tmp_path / "pieces"), str(work)]).returncode == 0
    names = tar_names(sorted((tmp_path / "pieces").glob("state.tar.*")))
    assert "control_2/final/model.safetensors" in names and not any("step_12" in n for n in names)


def test_learn_grpo_with_the_tower_beside_both_controls(sft_then_grpo, tmp_path):
    # CONTROL_TRAINS="same full": the fair control continues SFT on GRPO's trainable set (LoRA + tower) as a PEFT
    # adapter, and beside it the full-model control, all three on the one device for the same minutes
    copy, out = tmp_path / "work", tmp_path / "out"
    shutil.copytree(sft_then_grpo[1], copy, ignore=shutil.ignore_patterns("runs", "control_*"))  # fresh runs
    smoke = f"sft.steps=2 train.max_steps=1 lora.modules_to_save=[visual] {SMOKE}"
    env = dict(CONFIG="tests/tiny.yaml", DEVICE="cpu", EVAL_EVERY="1", EXTRA=smoke)
    wrong = run_script(["scripts/lab/learn.sh", "grpo", str(out), str(copy), "3"], CONTROL_TRAINS="same lora", **env)
    assert wrong.returncode == 2 and "CONTROL_TRAINS: full, same" in wrong.stdout and not (copy / "runs").exists()
    done = run_script(["scripts/lab/learn.sh", "grpo", str(out), str(copy), "3"], CONTROL_TRAINS="same full", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(m["step"] == 1 and "train_loss" in m for m in map(json.loads, open(out / "grpo_metrics.jsonl")))
    saved = json.loads((copy / "control_same_1" / "final" / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["visual"] and not (copy / "control_same_1" / "final" / "config.json").exists()
    assert (copy / "control_1" / "final" / "config.json").is_file()  # the full-model control: a whole model
    for log in ("control.jsonl", "control_same.jsonl"):
        assert any("eval_solve_rate" in m for m in map(json.loads, open(out / log))), log
    assert "\ncontrol 1@" in done.stdout and "\ncontrol (GRPO's trainable set) 1@" in done.stdout
    assert (out / "grpo_1.log").is_file()


def test_learn_watch_names_a_control_that_died_and_its_error(tmp_path):
    # a control that stops on an error (out of GPU memory beside the others) leaves its log in WORK only: the
    # watch call, which brings back OUT and stdout, names it and its last error line
    work = tmp_path / "work"
    for folder in ["start", "control_1/step_25", "control_same_1/step_50"]:
        (work / folder).mkdir(parents=True)
        (work / folder / "model.safetensors").write_text(folder)
    (work / "choice.env").write_text('START="start"\n')
    (work / "control_1.log").write_text("sft step 25\n")
    died = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    (work / "control_same_1.log").write_text(f"sft step 50\nTraceback (most recent call last):\n  File x\n{died}\n")
    (work / "detached.pid").write_text("999999999\n")  # the stage has ended
    done = run_script(["scripts/lab/learn.sh", "watch", str(tmp_path / "out"), str(work), "0"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"control control_same_1 failed: {died}" in done.stdout and "control control_1 failed" not in done.stdout
