"""The GRPO loop as one Ray application: 2 rollout actors + 2 FSDP2 trainer ranks on CPU bundles."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.observe.metrics import read_log
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "train.max_steps=2",
    "train.mazes_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_turns=9",
    "rollout.max_new_tokens=8",
    "eval.num_mazes=4",
    "eval.eval_interval=2",
    "checkpoint.ckpt_interval=2",
    "checkpoint.hf_save_interval=1",
    "placement.cpus_per_bundle=0.5",
    "metrics.progress_bar=false",
]


def run_main(tmp_path, *overrides):
    from app.main import main

    return main([str(ROOT / "tests" / "tiny.yaml"), f"output_dir={tmp_path}", *FAST, *overrides])


@pytest.fixture(scope="module")
def tiny_run(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    console = io.StringIO()
    with contextlib.redirect_stdout(console):  # metrics.progress_bar=false: the step lines are plain prints
        code = run_main(out, "eval.samples=2")
    assert code == 0, console.getvalue()[-4000:]
    (out / "tiny" / "console.txt").write_text(console.getvalue())
    return out / "tiny"


def test_tiny_job_trains_and_reports_every_step(tiny_run, capfd):
    log = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in log if m["step"] >= 1 and "train_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # step anatomy and the train-vs-rollout mismatch are measured every step
        for key in (
            "time_rollout_s",
            "time_train_s",
            "time_sync_s",
            "time_step_s",
            "train_grad_norm",
            "train_clip_fraction",
            "train_entropy",
            "rollout_generated_tokens_per_s",
            "lora_version",
        ):
            assert key in m, key
        assert m["train_logprob_mismatch_mean"] < 1e-4  # the same weights in engine and trainer, fp32 on CPU
        assert m["rollout_episodes"] == 4
    assert "eval_solve_rate" in log[0] and "eval_solve_rate" in steps[-1]
    assert steps[-1]["eval_solvable"] >= 1
    # eval.samples=2: the sampled play beside the greedy one, each maze twice at the rollout temperature
    for m in (log[0], steps[-1]):
        assert m["eval_sampled_samples"] == 2 and m["eval_sampled_temperature"] == 1.0
        assert 0.0 <= m["eval_sampled_solve_rate"] <= m["eval_sampled_pass_at_k"] <= 1.0


def test_eval_results_and_exports_are_written(tiny_run):
    evals = sorted((tiny_run / "eval").glob("eval_step_*.json"))
    assert [p.name for p in evals] == ["eval_step_000000.json", "eval_step_000002.json"]
    report = json.loads(evals[-1].read_text())
    assert len(report["mazes"]) == 4 and {"outcome", "solvable", "actions"} <= set(report["mazes"][0])
    from app.world.diagnosis import diagnosis_metrics

    # The why_ shares say what each held-out turn was, recomputed here from the report's own actions
    assert {k: v for k, v in report.items() if k.startswith("why_")} == diagnosis_metrics(report, 7)
    assert sum(v for k, v in report.items() if k.startswith("why_share_")) == pytest.approx(1.0)
    for step in (1, 2):
        folder = tiny_run / "export" / f"global_step_{step:06d}"
        assert (folder / "adapter_model.safetensors").is_file() and (folder / "adapter_config.json").is_file()
    assert (tiny_run / "checkpoints" / "latest").read_text().strip() == "global_step_000002"


def test_console_shows_solve_rate_and_anatomy(tiny_run):
    out = (tiny_run / "console.txt").read_text()
    line = next(x for x in out.splitlines() if x.startswith("step 1/2"))
    assert "eval solve" in line and "train solve" in line and "rollout" in line and "train" in line and "sync" in line


def test_dynamic_sampling_plays_a_second_round_and_trains_on_both(ray_cluster, tmp_path):
    """train.min_informative_groups=3 from 2 mazes a round: always one refill (refill_rounds=1 bounds it); the
    trainer sees 4 distinct groups, so the rounds' group numbers did not collide on the way through the actors."""
    assert (
        run_main(
            tmp_path,
            "train.max_steps=1",
            "eval.at_start=false",
            "checkpoint.ckpt_interval=0",
            "checkpoint.hf_save_interval=0",
            "train.min_informative_groups=3",
            "train.refill_rounds=1",
        )
        == 0
    )
    log = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in log if m["step"] == 1 and "train_loss" in m)
    assert step["rollout_rounds"] == 2 and step["rollout_episodes"] == 8
    assert 0 <= step["rollout_informative_groups"] <= 4
    assert step["train_groups"] == 4


@pytest.mark.parametrize(
    "saved", ["[]", "[visual]", "[visual,language_model]"], ids=["lora", "lora_and_vision_tower", "every_weight"]
)
def test_lora_on_every_rollout_actor_equals_rank0_bit_for_bit(ray_cluster, tmp_path, saved):
    import ray

    from actors.rollout import held_checksum
    from app.config import absolute_paths
    from app.driver.cluster import shutdown, spawn
    from app.driver.phases import rollout_phase, sync_lora
    from app.driver.waits import Waits
    from app.world.maze import generate_maze
    from app.world.sampler import MazeSampler
    from placement.plan import make_plan

    cfg = absolute_paths(tiny_config(f"output_dir={tmp_path}", *FAST, f"lora.modules_to_save={saved}"))
    waits = Waits(cfg.waits)
    actors = spawn(cfg, make_plan(cfg), waits)
    try:
        initial = [t.lora.remote() for t in actors.trainers][0]
        sync_lora(actors, initial, 0, waits)
        sampler = MazeSampler(cfg.train.seed, 8, cfg.maze.size, set())
        # a supervised step moves the adapter away from its init (a random policy earns no GRPO signal)
        ray.get([t.sft_step.remote([m.seed for m in sampler.next(2)], 1e-2) for t in actors.trainers])
        # groups from random cells (train.random_starts): the rollout actors play the maze they are handed, start
        # included
        moved = MazeSampler(cfg.train.seed, 8, cfg.maze.size, set(), random_starts=1.0).next(2)
        _, refs = rollout_phase(actors, moved, cfg, 1, 0, waits)
        played = [t for batch in ray.get(refs) for t in batch]
        assert {t.group for t in played} == {0, 1}
        assert all(t.optimal_moves == moved[t.group].shortest_path_length for t in played)
        assert any(t.optimal_moves != generate_maze(t.maze_seed, cfg.maze.size).shortest_path_length for t in played)
        results = [t.step.remote(refs, 1) for t in actors.trainers]
        ray.get([m for m, _ in results])
        sync_lora(actors, results[0][1], 1, waits)
        rank0 = held_checksum(ray.get(results[0][1]), cfg.lora)
        held = ray.get([a.lora_checksum.remote() for a in actors.rollouts])
        assert held == [rank0, rank0]
        assert rank0 != held_checksum(ray.get(initial), cfg.lora)  # the update did change the adapter
    finally:
        shutdown(actors)


def test_several_rollout_actors_a_bundle_play_their_shares_and_hold_rank0s_lora(ray_cluster, tmp_path):
    """placement.rollouts_per_bundle=2 on 2 bundles: 4 rollout actors for 2 trainer ranks. Each plays its share of a
    round, each draws its own random numbers (the same maze handed to two actors is played differently), and after
    a sync every one of them generates with rank 0's adapter."""
    import ray

    from actors.rollout import held_checksum
    from app.config import absolute_paths
    from app.driver.cluster import shutdown, spawn
    from app.driver.phases import rollout_phase, sync_lora
    from app.driver.waits import Waits
    from app.world.sampler import MazeSampler
    from placement.plan import make_plan

    cfg = absolute_paths(tiny_config(f"output_dir={tmp_path}", *FAST, "placement.rollouts_per_bundle=2"))
    plan = make_plan(cfg)
    assert plan.num_rollouts == 4 and plan.num_pairs == 2
    waits = Waits(cfg.waits)
    actors = spawn(cfg, plan, waits)
    try:
        assert len(actors.rollouts) == 4 and len(actors.trainers) == 2
        sync_lora(actors, [t.lora.remote() for t in actors.trainers][0], 0, waits)
        maze = MazeSampler(cfg.train.seed, 8, cfg.maze.size, set()).next(1)[0]
        _, refs = rollout_phase(actors, [maze] * 4, cfg, 1, 0, waits)  # group k goes to actor k: one maze, four actors
        by_actor = ray.get(refs)
        assert [{t.group for t in batch} for batch in by_actor] == [{0}, {1}, {2}, {3}]
        replies = [tuple(tuple(t.replies) for t in batch) for batch in by_actor]
        assert len(set(replies)) == 4, "two rollout actors drew the same random numbers"
        assert all(s["prompts"] > 0 for s in ray.get([a.stats.remote() for a in actors.rollouts]))
        results = [t.step.remote(refs, 1) for t in actors.trainers]
        ray.get([m for m, _ in results])
        sync_lora(actors, results[0][1], 1, waits)
        rank0 = held_checksum(ray.get(results[0][1]), cfg.lora)
        assert ray.get([a.lora_checksum.remote() for a in actors.rollouts]) == [rank0] * 4
    finally:
        shutdown(actors)


def test_bounded_steps_on_two_fsdp_ranks_fit_the_bound_in_lockstep(ray_cluster, tmp_path):
    """train.max_update_kl under FSDP2: both ranks measure the same all-reduced KL, halve the same step the same
    number of times (their collectives would hang otherwise), and the kept step fits the bound."""
    import dataclasses

    import ray

    from actors.rollout import lora_checksum
    from app.config import absolute_paths
    from app.driver.cluster import shutdown, spawn
    from app.driver.phases import rollout_phase, sync_lora
    from app.driver.waits import Waits
    from app.world.sampler import MazeSampler
    from placement.plan import make_plan

    bound = 1e-5
    cfg = absolute_paths(
        tiny_config(
            f"output_dir={tmp_path}", *FAST, "train.update_epochs=2", "train.lr=0.05", f"train.max_update_kl={bound}"
        )
    )
    waits = Waits(cfg.waits)
    actors = spawn(cfg, make_plan(cfg), waits)
    try:
        initial = [t.lora.remote() for t in actors.trainers][0]  # a collective: every rank is called at once
        sync_lora(actors, initial, 0, waits)
        _, refs = rollout_phase(actors, MazeSampler(cfg.train.seed, 8, cfg.maze.size, set()).next(2), cfg, 1, 0, waits)
        # rewards 0 and 1 within each group, so that the step has a gradient to follow (a random policy earns none)
        rewarded = [
            ray.put([dataclasses.replace(t, reward=float(t.sample % 2)) for t in batch]) for batch in ray.get(refs)
        ]
        results = [t.step.remote(rewarded, 1) for t in actors.trainers]
        metrics = ray.get([m for m, _ in results])
        moved = {k: [m[k] for m in metrics] for k in ("step_kl", "update_scale", "update_halvings", "passes_done")}
        assert all(len(set(v)) == 1 for v in moved.values()), moved  # in lockstep
        assert metrics[0]["grad_norm"] > 0 and metrics[0]["update_halvings"] >= 1
        assert metrics[0]["step_kl"] <= bound and metrics[0]["update_scale"] < 1.0 and metrics[0]["passes_done"] == 1
        after = lora_checksum(ray.get(results[0][1]))
        assert (after != lora_checksum(ray.get(initial))) == (
            metrics[0]["update_scale"] > 0
        )  # a kept share moves the adapter, a dropped one not
    finally:
        shutdown(actors)


def test_plan_prints_placement_without_starting_anything():
    out = subprocess.run(
        [sys.executable, "-m", "app.main", "tests/tiny.yaml", "--plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    assert "bundle 0" in out.stdout and "rollout-0" in out.stdout and "trainer-1" in out.stdout
    assert "consolidator" in out.stdout and "head node" in out.stdout


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["train.lr=-1"], "train.lr"),
        (["rollout.engin=hf"], "rollout.engin"),
        (["train.mazes_per_step=3", "rollout.n_samples_per_prompt=3"], "train.mazes_per_step"),
    ],
)
def test_bad_config_is_one_message_and_exit_code_2(overrides, field):
    out = subprocess.run(
        [sys.executable, "-m", "app.main", "tests/tiny.yaml", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert field in out.stderr and "Fix:" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_warm_start_checks_its_validation_mazes_until_the_target_or_its_last_step(ray_cluster, tmp_path):
    """sft.target_solve_rate: after sft.steps, a greedy check on training mazes set aside every check_every steps;
    a target not met ends the warm start at sft.max_steps, and GRPO goes on from there."""
    overrides = ["train.max_steps=1", "sft.steps=2", "sft.check_every=2", "sft.max_steps=5"]
    overrides += ["sft.target_solve_rate=1.0", "sft.validation_mazes=3", "sft.mazes_per_step=2"]
    assert run_main(tmp_path, *overrides) == 0
    records = read_log(tmp_path / "tiny" / "metrics.jsonl")
    warm = [r for r in records if "sft_step" in r]
    assert [r["sft_step"] for r in warm] == [1, 2, 3, 4, 5] and {r["sft_most"] for r in warm} == {5}
    checked = [r["sft_step"] for r in warm if "sft_validation_solve_rate" in r]
    assert checked == [2, 4]  # from sft.steps, every check_every
    assert all(r["sft_validation_num_mazes"] == 3 and r["sft_target"] == 1.0 for r in warm if r["sft_step"] in checked)
    assert [r["step"] for r in records if "train_loss" in r] == [1]


@pytest.mark.parametrize("saved", [["visual"], ["visual", "language_model"]], ids=["vision_tower", "every_weight"])
def test_a_job_that_trains_whole_modules_checkpoints_and_exports_them(ray_cluster, tmp_path, saved):
    from app.model import adapters

    assert run_main(tmp_path, f"lora.modules_to_save=[{','.join(saved)}]", "eval.num_mazes=2") == 0
    run = tmp_path / "tiny"
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in log if m["step"] >= 1 and "train_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["train_logprob_mismatch_mean"] < 1e-4 for m in steps)  # the engines play the trained tower
    folders = [p.parent for p in run.rglob(adapters.ADAPTER_CONFIG)]
    assert folders
    for folder in folders:
        tensors, config = adapters.read_peft_folder(folder)
        assert config["modules_to_save"] == saved
        assert any(k.startswith(adapters.VISION_PREFIX) for k in tensors), folder
        assert any(adapters.is_language_weight(k) for k in tensors) == ("language_model" in saved), folder


def test_playing_ahead_trains_each_batch_one_version_after_the_adapter_that_played_it(ray_cluster, tmp_path):
    """rollout.play_ahead: step k+1's episodes play while step k trains, so step 2's batch was played by the initial
    adapter (version 0) like step 1's. A checkpoint stores the sampler just past its own step's mazes, not those
    played ahead: a rollout actor lost after step 2 drops step 3's batch played ahead, and the resumed run plays
    step 3's mazes again, by step 2's adapter."""
    from app.world.sampler import MazeSampler, eval_mazes
    from tests.driver.test_reference_loop import kill_rollout_after

    overrides = ["train.max_steps=3", "eval.at_start=false", "eval.eval_interval=0", "checkpoint.hf_save_interval=0"]
    overrides += ["checkpoint.ckpt_interval=2", "rollout.play_ahead=true", "rollout.sleep_level=0"]
    overrides += ["train.rollout_ratio_cap=2"]
    watcher = kill_rollout_after(tmp_path / "tiny", 2)
    assert run_main(tmp_path, *overrides) == 0
    watcher.join(timeout=1)
    records = read_log(tmp_path / "tiny" / "metrics.jsonl")
    steps = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[-1]["recoveries"] == 1
    assert [r["rollout_lora_version"] for r in steps] == [0, 0, 2]  # without the loss, step 3's would be 1
    assert [r["lora_version"] for r in steps] == [1, 2, 3]
    assert all(r["time_rollout_s"] > 0 and r["time_step_s"] >= r["time_train_s"] for r in steps)
    cfg = tiny_config(*FAST, *overrides)
    held_out = {m.identity for m in eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)}
    sampler = MazeSampler(
        cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, held_out, random_starts=cfg.train.random_starts
    )
    for _ in range(2):
        sampler.next(cfg.train.mazes_per_step)
    saved = json.loads((tmp_path / "tiny" / "checkpoints" / "global_step_000002" / "state.json").read_text())
    assert saved["state"]["sampler"] == sampler.state_dict()
    sampler.next(cfg.train.mazes_per_step)  # step 3's mazes, played ahead while step 2 trained, and again after
    final = json.loads((tmp_path / "tiny" / "checkpoints" / "global_step_000003" / "state.json").read_text())
    assert final["state"]["sampler"] == sampler.state_dict() != saved["state"]["sampler"]
