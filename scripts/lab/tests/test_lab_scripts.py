"""The lab's GPU stages (learn.sh, probe_sweep.sh, their choosers) run on a CPU too: the smoke runs they describe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lab_shell import SMOKE, run_script, tar_names


def test_probe_sweep_runs_variants_side_by_side_and_tabulates_them(tmp_path):
    out = tmp_path / "out"
    # 5 minutes only bound the variants, which stop at their --steps; 1 ran out on a loaded 2-core machine
    done = run_script(
        ["scripts/lab/probe_sweep.sh", str(out), "5", "tests/tiny.yaml"],
        VARIANTS_SPEC="two:eval.num_mazes=2,--steps=2 three:--steps=3,eval.num_mazes=2,maze.cell_px=8",
        PROBE_ARGS="--device cpu --batch 2 --eval-every 1 --steps 5",
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    # a variant's own --steps wins over the common one
    assert [(r["variant"], r["step"]) for r in rows] == [
        ("three", 1),
        ("three", 2),
        ("three", 3),
        ("two", 1),
        ("two", 2),
    ]
    table = done.stdout.split("=== perception probe")[1]
    assert "two " in table and "three " in table and "best" in table
    assert (out / "probe_logs.tar.gz").stat().st_size > 0


def test_learn_see_then_sft_starts_the_warm_start_from_the_model_that_sees(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = run_script(
        ["scripts/lab/learn.sh", "see+sft", str(out), str(work), "0.4"],
        DEVICE="cpu",
        SEE_EVAL_EVERY="2",
        SEE_BATCH="2",
        SEE_MINUTES="0.05",
        SEE_ROOMS="0.7",
        EVAL_EVERY="1",
        SIZES="7",
        SFT_LRS="3e-4",
        EXTRA="eval.num_mazes=2 sft.mazes_per_step=2 sft.variants=1 rollout.max_turns=12 train.picture_cache_gb=0",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    log = [json.loads(line) for line in (out / "see.jsonl").read_text().splitlines()]
    assert log and all(0.0 <= e["p_exact"] <= 1.0 for e in log)
    config = json.loads((work / "seeing" / "config.json").read_text())
    assert (
        config["text_config"]["rope_parameters"]["rope_theta"] == 10_000.0
    )  # scripts/lab/configs/learn_h200.yaml's model
    assert (work / "seeing" / "model.safetensors").is_file() and (work / "seeing" / "tokenizer.json").is_file()
    # the SFT stage ran from that folder, logged the why_ classes, and chose a GRPO start
    assert "SFT from " + str(work / "seeing") in done.stdout
    sft = [json.loads(line) for line in (out / "sft_s7_lr3e-4.jsonl").read_text().splitlines()]
    assert any("eval_why_first_try_open" in e for e in sft)
    choice = (work / "choice.env").read_text()
    assert "START=" in choice and f"model.path={work / 'seeing'}" not in choice  # the start is an SFT checkpoint


def test_learn_sft_evaluates_densely_past_fine_eval_and_fails_when_no_start_qualifies(tmp_path):
    """FINE_EVAL="0 1": every step is evaluated after the first reading; START_AT_MOST=-1: no checkpoint can qualify,
    so the stage exits 4 (not 0), and a stage chained after it with && does not start."""
    out, work = tmp_path / "out", tmp_path / "work"
    done = run_script(
        ["scripts/lab/learn.sh", "sft", str(out), str(work), "0.5"],
        DEVICE="cpu",
        EVAL_EVERY="2",
        FINE_EVAL="0 1",
        START_AT_MOST="-1",
        SIZES="7",
        SFT_LRS="3e-4",
        EXTRA="eval.num_mazes=1 sft.mazes_per_step=1 sft.variants=1 rollout.max_turns=12 train.picture_cache_gb=0",
    )
    assert done.returncode == 4, done.stdout + done.stderr
    assert "no GRPO start chosen" in done.stdout and not (work / "choice.env").exists()
    sft = [json.loads(line) for line in (out / "sft_s7_lr3e-4.jsonl").read_text().splitlines()]
    evaluated = [e["sft_step"] for e in sft if "eval_solve_rate" in e]
    assert evaluated[0] == 2 and evaluated == list(range(2, sft[-1]["sft_step"] + 1)), evaluated
    assert len(evaluated) >= 3, evaluated  # not only the first and the last step's (a last step is always evaluated)


def _sft_log(folder: Path, evaluations: list[tuple[int, float, float]], overrides: str = "sft.lr=3e-4") -> None:
    folder.mkdir(parents=True)
    lines = []
    for step, rate, seeing in evaluations:
        (folder / f"step_{step}").mkdir()
        lines.append(
            json.dumps(
                {"sft_step": step, "elapsed_s": 10.0 * step, "eval_solve_rate": rate, "eval_why_first_try_open": seeing}
            )
        )
        lines.append(json.dumps({"sft_step": step + 1, "elapsed_s": 10.0 * step + 5, "sft_nll": 0.1}))  # a train record
    (folder / "sft_log.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "overrides.txt").write_text(overrides + "\n")


def test_choose_start_picks_the_best_seeing_checkpoint_at_most_half_solved(tmp_path, capsys):
    from scripts.lab.choose_start import main as choose_main

    _sft_log(tmp_path / "sft_a", [(10, 0.30, 0.70), (20, 0.50, 0.91), (30, 0.62, 0.95)], "sft.lr=3e-4 sft.perception=4")
    _sft_log(tmp_path / "sft_b", [(10, 0.45, 0.80), (20, 0.48, 0.91)])
    assert choose_main([str(tmp_path), "--by", "seeing"]) == 0
    choice = (tmp_path / "choice.env").read_text()
    # 0.95 sees best but solves 62%: not a start; of the two at 0.91, the higher solve rate wins
    assert 'START="sft_a/step_20"' in choice and 'OVERRIDES="sft.lr=3e-4 sft.perception=4"' in choice
    assert "START_RATE=0.5\n" in choice and "START_SEEING=0.91\n" in choice and "SFT_STEP=20\n" in choice
    assert "sft_b 10:0.45/0.80 20:0.48/0.91" in capsys.readouterr().out  # the table, every evaluation
    assert choose_main([str(tmp_path), "--by", "rate"]) == 0
    assert 'START="sft_a/step_20"' in (tmp_path / "choice.env").read_text()
    assert choose_main([str(tmp_path), "--by", "rate", "--most", "0.46"]) == 0
    assert 'START="sft_b/step_10"' in (tmp_path / "choice.env").read_text()
    assert choose_main([str(tmp_path), "--most", "0.2"]) == 1  # nothing qualifies: no start, and it says so
    assert "no checkpoint with a solve rate <= 0.2" in capsys.readouterr().err
    # by rate among the checkpoints that see at least 0.91: sft_a step 20 (0.50) over sft_b step 20 (0.48); none at 0.92
    assert choose_main([str(tmp_path), "--by", "rate", "--seeing-at-least", "0.91"]) == 0
    assert 'START="sft_a/step_20"' in (tmp_path / "choice.env").read_text()
    assert choose_main([str(tmp_path), "--by", "rate", "--seeing-at-least", "0.92"]) == 1


def test_learn_sft_then_grpo_runs_both_with_the_control_in_one_call(sft_then_grpo):
    out, work, done = sft_then_grpo
    assert (out / "choice.env").is_file() and not list(out.glob("start.tar.*"))  # nothing to carry: GRPO ran here
    assert "sft stage done; GRPO for" in done.stdout
    grpo = [json.loads(line) for line in (out / "grpo_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in grpo if "eval_solve_rate" in m][:2] == [0, 1]  # the start, then after the GRPO step
    assert any("eval_why_first_try_open" in m for m in grpo)
    control = [json.loads(line) for line in (out / "control.jsonl").read_text().splitlines()]
    assert any("eval_solve_rate" in m for m in control)
    assert "grpo    0:" in done.stdout and "control " in done.stdout
    # the GRPO stage never re-runs a warm start in app.main, whatever EXTRA says (sft.steps=3 was for the sft stage)
    assert not any("sft_step" in m for m in grpo)


def test_learn_packs_the_run_and_a_fresh_work_folder_resumes_grpo_and_the_control(sft_then_grpo, tmp_path):
    out, work, _ = sft_then_grpo
    pieces = tmp_path / "carried"
    packed = run_script(["scripts/lab/learn.sh", "pack", str(pieces), str(work)])
    assert packed.returncode == 0, packed.stdout + packed.stderr
    # a later session: nothing of WORK is left but what was carried back
    fresh = tmp_path / "fresh"
    shutil.copytree(work, fresh)
    shutil.rmtree(work)
    try:
        unpacked = run_script(["scripts/lab/learn.sh", "unpack", str(pieces), str(work)])
        assert unpacked.returncode == 0, unpacked.stdout + unpacked.stderr
        assert not (work / "sft_s7_lr3e-4" / "sft_log.jsonl").exists()  # only what going on needs came back
        resumed = run_script(
            ["scripts/lab/learn.sh", "grpo", str(tmp_path / "out2"), str(work), "4"],
            CONFIG="tests/tiny.yaml",
            DEVICE="cpu",
            EVAL_EVERY="1",
            EXTRA=f"sft.steps=2 train.max_steps=2 {SMOKE}",
        )
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        grpo = [json.loads(line) for line in (tmp_path / "out2" / "grpo_metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in grpo if "train_loss" in m] == [1, 2]  # step 1 from the first call, step 2 now
        assert "resuming from checkpoint" in (tmp_path / "out2" / "grpo_2.log").read_text()  # the second round
        control = [json.loads(line) for line in (tmp_path / "out2" / "control.jsonl").read_text().splitlines()]
        assert [m["sft_step"] for m in control if "eval_solve_rate" in m][-1] == 2  # round 2, from round 1's model
        assert (work / "control_2" / "final").is_dir()
        # the resumed call packed its delta: the carried state's pieces and it, unpacked together on a machine that
        # lost WORK again, hold call 2's checkpoint and control model beside call 1's start model
        delta = sorted((tmp_path / "out2").glob("delta.tar.*"))
        assert delta and "delta: " in resumed.stdout
        start = dict(line.split("=", 1) for line in (work / "choice.env").read_text().splitlines() if "=" in line)
        start_model = start["START"].strip("'\"")
        names = tar_names(delta)
        assert "control_2/final/model.safetensors" in names and not any(n.startswith(start_model) for n in names)
        both = tmp_path / "both"
        shutil.copytree(pieces, both)
        for piece in delta:
            shutil.copy(piece, both)
        again = tmp_path / "again"
        assert run_script(["scripts/lab/learn.sh", "unpack", str(both), str(again)]).returncode == 0
        latest = (again / "runs" / "learn" / "checkpoints" / "latest").read_text().strip()
        assert latest == (work / "runs" / "learn" / "checkpoints" / "latest").read_text().strip() != ""
        assert (again / "control_2" / "final").is_dir() and (again / "control_2" / "sft_log.jsonl").is_file()
        assert (again / start_model / "model.safetensors").is_file()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(fresh, work)
    assert run_script(["scripts/lab/learn.sh", "unpack", str(tmp_path / "none"), str(work)]).returncode == 2


def test_learn_see_variants_side_by_side_the_first_to_pass_wins_and_the_rest_stop(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    # SEE_ABOVE -1: any evaluation passes. "quick" evaluates after its first step and stops there; "slow" would run
    # for its minute without evaluating, so it is stopped unsaved when quick passes.
    done = run_script(
        ["scripts/lab/learn.sh", "see", str(out), str(work), "1"],
        CONFIG="tests/tiny.yaml",
        DEVICE="cpu",
        SEE_BATCH="2",
        SEE_ABOVE="-1",
        SEE_CACHE_GB="0",
        SEE_VARIANTS="quick:--eval-every=1,eval.num_mazes=2 slow:--eval-every=100000,--rooms=0.8",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "see variant quick passed -1" in done.stdout
    assert (work / "seeing").resolve() == (work / "seeing_quick").resolve()
    assert (work / "seeing" / "model.safetensors").is_file() and not (work / "seeing_slow").exists()
    quick = [json.loads(line) for line in (out / "see_quick.jsonl").read_text().splitlines()]
    assert [e["step"] for e in quick] == [1]


def test_choose_seeing_takes_the_best_saved_variant(tmp_path, capsys):
    from scripts.lab.choose_seeing import main as choose_main

    def variant(name: str, p_exacts: list[float], saved: bool) -> Path:
        log = tmp_path / f"see_{name}.jsonl"
        log.write_text("".join(json.dumps({"step": 25 * (i + 1), "p_exact": p}) + "\n" for i, p in enumerate(p_exacts)))
        if saved:
            (tmp_path / f"seeing_{name}").mkdir()
            (tmp_path / f"seeing_{name}" / "config.json").write_text("{}")
        return log

    a, b, c = variant("a", [0.2, 0.9], True), variant("b", [0.5, 0.8], True), variant("c", [0.99], False)
    assert choose_main(["--passed", "0.85", str(a)]) == 0 and choose_main(["--passed", "0.85", str(b)]) == 1
    assert choose_main([str(tmp_path), str(a), str(b), str(c)]) == 0  # c scores best but saved nothing
    assert capsys.readouterr().out.strip() == "a"
    assert choose_main([str(tmp_path), str(c)]) == 1
    assert choose_main(["--passed", "0.1", str(tmp_path / "see_none.jsonl")]) == 1  # no log yet: not passed


def test_learn_grpo_goes_on_without_cuda_graphs_when_the_run_with_them_fails(sft_then_grpo, tmp_path):
    _, work, _ = sft_then_grpo
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    # a python on PATH whose app.main fails unless CUDA graphs were turned off: the first run fails at start, as an
    # engine that cannot capture graphs would
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ " $* " == *" -m app.main "* && " $* " != *" rollout.enforce_eager=true "* ]]; then '
        'echo "engine failed to capture CUDA graphs"; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    (shim / "python").chmod(0o755)
    out = tmp_path / "out"
    done = run_script(
        ["scripts/lab/learn.sh", "grpo", str(out), str(copy), "4"],
        CONFIG="tests/tiny.yaml",
        DEVICE="cpu",
        EVAL_EVERY="1",
        CONTROL="0",  # the retries are GRPO's; the control's own stage has its tests
        PATH=f"{shim}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        EXTRA=f"sft.steps=2 train.max_steps=2 rollout.enforce_eager=false {SMOKE}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "again without them" in done.stdout
    log = (out / "grpo_2.log").read_text()
    assert "engine failed to capture CUDA graphs" in log and "resuming from checkpoint" in log  # both tries logged
    grpo = [json.loads(line) for line in (out / "grpo_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in grpo if "train_loss" in m] == [1, 2]
    # a run without CUDA graphs that fails is not run again: that retry would change nothing
    eager = run_script(
        ["scripts/lab/learn.sh", "grpo", str(tmp_path / "out2"), str(copy), "4"],
        CONFIG="tests/tiny.yaml",
        DEVICE="cpu",
        EVAL_EVERY="1",
        CONTROL="0",
        PATH=f"{shim}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        EXTRA=f"sft.steps=2 train.max_steps=3 {SMOKE}",
    )
    assert eager.returncode == 0, eager.stdout + eager.stderr
    assert "again without them" not in eager.stdout
    # no new control in either call: this is round 2 again, after the shared run's first
    assert (tmp_path / "out2" / "grpo_2.log").read_text().count("engine failed to capture CUDA graphs") == 1
    # RETRY_EXTRA: a failed run goes on with those overrides instead (here: one engine a bundle, not two), graphs or not
    (shim / "python").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ " $* " == *" -m app.main "* && " $* " != *" placement.rollouts_per_bundle=1 "* ]]; then '
        'echo "engines failed to start side by side"; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    several = run_script(
        ["scripts/lab/learn.sh", "grpo", str(tmp_path / "out3"), str(copy), "4"],
        CONFIG="tests/tiny.yaml",
        DEVICE="cpu",
        EVAL_EVERY="1",
        CONTROL="0",
        PATH=f"{shim}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        RETRY_EXTRA="placement.rollouts_per_bundle=1",
        EXTRA=f"sft.steps=2 train.max_steps=4 placement.rollouts_per_bundle=2 {SMOKE}",
    )
    assert several.returncode == 0, several.stdout + several.stderr
    assert "again with RETRY_EXTRA (placement.rollouts_per_bundle=1)" in several.stdout
    grpo = [json.loads(line) for line in (tmp_path / "out3" / "grpo_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in grpo if "train_loss" in m][-1] == 4


def test_learn_start_detaches_the_grpo_stage_and_watch_brings_its_run_back(sft_then_grpo, tmp_path):
    _, work, _ = sft_then_grpo
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    env = dict(CONFIG="tests/tiny.yaml", DEVICE="cpu", EVAL_EVERY="1", EXTRA=f"sft.steps=2 train.max_steps=2 {SMOKE}")
    started = run_script(["scripts/lab/learn.sh", "start", str(tmp_path / "unused"), str(copy), "4"], **env)
    assert started.returncode == 0, started.stdout + started.stderr
    pid = int((copy / "detached.pid").read_text())
    try:
        # the stage outlived the call that started it, and a second start does not run a second stage beside it
        os.kill(pid, 0)
        assert run_script(["scripts/lab/learn.sh", "start", str(tmp_path / "unused"), str(copy), "4"]).returncode == 2
        early = run_script(["scripts/lab/learn.sh", "watch", str(tmp_path / "early"), str(copy), "0"])
        assert early.returncode == 3, early.stdout + early.stderr  # it runs on
        assert "the detached stage runs on" in early.stdout and list((tmp_path / "early").glob("delta.tar.*"))
        out = tmp_path / "out"
        done = run_script(["scripts/lab/learn.sh", "watch", str(out), str(copy), "540"])
        assert done.returncode == 0, done.stdout + done.stderr
        assert "the detached stage has ended" in done.stdout and "grpo    0:" in done.stdout
    finally:
        subprocess.run(["kill", "--", f"-{pid}"], capture_output=True)
    grpo = [json.loads(line) for line in (out / "grpo_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in grpo if "train_loss" in m] == [1, 2]
    assert "resuming from checkpoint" in (out / "grpo_2.log").read_text()
    names = tar_names(sorted(out.glob("delta.tar.*")))
    assert "control_2/final/model.safetensors" in names and "runs/learn/checkpoints/latest" in names
    assert "control_2/sft_log.jsonl" in names and "control_1/sft_log.jsonl" in names
