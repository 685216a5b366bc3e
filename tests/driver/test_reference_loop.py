"""The reference run's path through the driver loop, at tiny size: a warm start written by scripts/sft.py, the
loss as one number whatever the rank count, the end-of-run evaluation, and recovery that always resumes from this
run's own newest checkpoint (or from its start, sampler included, when it has none)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.driver.test_loop import run_main

ROOT = Path(__file__).resolve().parents[2]
FOUR_STEPS = ["train.max_steps=4", "eval.at_start=false", "eval.eval_interval=0", "checkpoint.hf_save_interval=0"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir) if "train_loss" in m]


def final_adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "adapter_model.safetensors"))


def kill_rollout_after(run_dir: Path, step: int, timeout: float = 600) -> threading.Thread:
    """Kills rollout-0 once `step` is recorded: the driver meets a lost actor in its next step."""
    import ray

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and step in trained(run_dir):
                ray.kill(ray.get_actor("rollout-0"))
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    assert run_main(out, *FOUR_STEPS, "checkpoint.resume_mode=none") == 0
    return out / "tiny"


def test_the_loss_is_the_token_mean_whatever_the_number_of_ranks(uninterrupted):
    # tiny.yaml trains on 2 ranks; with no KL and no entropy bonus the loss is the clipped surrogate's token mean
    for m in metrics(uninterrupted):
        if "train_loss" in m:
            assert m["train_loss"] == pytest.approx(m["train_pg_loss"], rel=1e-5, abs=1e-7)


def test_eval_interval_zero_still_evaluates_at_the_end(uninterrupted):
    assert sorted(p.name for p in (uninterrupted / "eval").glob("eval_step_*.json")) == ["eval_step_000004.json"]
    assert "eval_solve_rate" in next(m for m in metrics(uninterrupted) if m["step"] == 4 and "train_loss" in m)


@pytest.mark.slow
def test_a_recovery_resumes_from_this_runs_newest_checkpoint_not_an_older_runs(uninterrupted, tmp_path):
    """resume_mode none, and the checkpoint folder holds an older run's step 10: a loss after step 3 resumes from
    this run's step 2, and the run ends as the uninterrupted one, bit for bit."""
    older = tmp_path / "tiny" / "checkpoints" / "global_step_000010"
    shutil.copytree(uninterrupted / "checkpoints" / "global_step_000004", older)
    watcher = kill_rollout_after(tmp_path / "tiny", 3)
    assert run_main(tmp_path, *FOUR_STEPS, "checkpoint.resume_mode=none") == 0
    watcher.join(timeout=1)
    run = tmp_path / "tiny"
    assert trained(run) == [1, 2, 3, 3, 4]  # step 3 redone after the loss, from step 2's checkpoint
    assert next(m for m in metrics(run) if "recoveries" in m and "train_loss" not in m)["recoveries"] == 1
    a, b = final_adapter(uninterrupted), final_adapter(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_loss_before_the_first_checkpoint_starts_over_with_the_sampler_rewound(uninterrupted, tmp_path):
    watcher = kill_rollout_after(tmp_path / "tiny", 1)
    assert run_main(tmp_path, *FOUR_STEPS, "checkpoint.resume_mode=none") == 0
    watcher.join(timeout=1)
    run = tmp_path / "tiny"
    assert trained(run)[:2] == [1, 1] and trained(run)[-1] == 4
    a, b = final_adapter(uninterrupted), final_adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same mazes as the uninterrupted run, in the same order


@pytest.mark.slow
def test_the_loop_trains_from_an_adapter_written_by_the_sft_script(ray_cluster, tmp_path):
    from scripts.sft import main as sft_main

    sft = tmp_path / "sft"
    # the loop's episode settings (tests/driver/test_loop.py's FAST), so that both evaluations play the same episodes
    same = ["rollout.max_turns=9", "rollout.max_new_tokens=8", "eval.num_mazes=4"]
    overrides = [f"output_dir={tmp_path}", "sft.steps=3", "sft.lr=3e-3", "sft.mazes_per_step=4", *same]
    assert sft_main([str(ROOT / "tests" / "tiny.yaml"), str(sft), *overrides]) == 0
    sft_eval = [json.loads(line) for line in (sft / "sft_log.jsonl").read_text().splitlines()][-1]
    assert run_main(tmp_path, "train.max_steps=1", f"model.adapter_init={sft / 'final'}") == 0
    log = metrics(tmp_path / "tiny")
    # step 0: the engines play the SFT adapter itself (same engine kind, greedy, the same held-out mazes)
    assert log[0]["step"] == 0 and log[0]["eval_solve_rate"] == sft_eval["eval_solve_rate"]
    assert log[0]["eval_invalid_action_rate"] == pytest.approx(sft_eval["eval_invalid_action_rate"])
    step1 = next(m for m in log if m["step"] == 1 and "train_loss" in m)
    assert step1["train_logprob_mismatch_mean"] < 1e-4
    start = load_file(str(sft / "final" / "adapter_model.safetensors"))
    after = load_file(str(tmp_path / "tiny" / "export" / "global_step_000001" / "adapter_model.safetensors"))
    assert start.keys() == after.keys()
    if step1["train_zero_variance_groups"] == step1["train_groups"]:  # no group earned differing rewards: no update
        assert all(torch.equal(start[k], after[k]) for k in start)  # so the trainer held the SFT adapter exactly
    else:
        assert any(not torch.equal(start[k], after[k]) for k in start)
    exported = json.loads((tmp_path / "tiny" / "export" / "global_step_000001" / "adapter_config.json").read_text())
    assert (exported["r"], exported["lora_alpha"]) == (16, 32)  # tiny.yaml's lora.*, which the adapter matches


def test_storage_that_cannot_be_used_is_one_clear_error_before_any_actor(moto_s3, tmp_path, capsys):
    """The bucket is checked (and the credentials with it) before Ray or any actor starts: exit 2, one line."""
    import ray

    from app.main import main

    tiny = str(ROOT / "tests" / "tiny.yaml")
    cases = [
        (["checkpoint.s3_uri=s3://no-such-bucket/run", f"checkpoint.s3_endpoint_url={moto_s3.endpoint_url}"], "s3_uri"),
        (["checkpoint.s3_uri=s3://any/run", "checkpoint.s3_endpoint_url=http://127.0.0.1:9"], "s3_uri"),
        ([f"checkpoint.ckpt_path={tmp_path / 'file'}/sub"], "ckpt_path"),
    ]
    (tmp_path / "file").write_text("a file, not a folder")
    was_up = ray.is_initialized()
    for overrides, field in cases:
        started = time.monotonic()
        assert main([tiny, f"output_dir={tmp_path}", *overrides]) == 2
        err = capsys.readouterr().err
        assert f"checkpoint.{field}" in err and "Fix:" in err and len(err.strip().splitlines()) == 1, err
        assert time.monotonic() - started < 60
    assert ray.is_initialized() == was_up  # no Ray started for a run that cannot store its checkpoints
