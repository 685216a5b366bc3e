"""app/observe/report.py on a synthetic run folder: real mazes, BFS-solver actions, a metrics log with a recovery."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from app.config import describe
from app.observe import replay, report, run_files
from app.world.dialogue import format_action, solver_actions
from app.world.episode import MazeEpisode
from app.world.maze import Action, generate_maze
from app.world.render import AGENT_RGB
from app.world.sampler import eval_mazes
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _play(maze, max_turns: int, actions: list[str | None]) -> dict:
    """The evaluator's per-maze record for these actions (outcome and counts from the real environment)."""
    from app.world.dialogue import parse_action

    env = MazeEpisode(maze, max_turns)
    for text in actions:
        env.step(parse_action(text) if text else None)
        if env.done:
            break
    return {
        "seed": maze.seed,
        "maze_id": maze.identity,
        "outcome": env.outcome,
        "turns": env.turns,
        "moves": env.moves,
        "optimal_moves": maze.shortest_path_length,
        "solvable": maze.solvable_within(max_turns),
        "invalid_actions": env.invalid_actions,
        "actions": actions[: env.turns],
    }


def _eval_json(cfg, step: int, solved: bool) -> dict:
    size, max_turns = cfg.maze.size, cfg.rollout.max_turns
    mazes = eval_mazes(cfg.eval.seed, 4, size)
    wander = [None, format_action(Action.move(1)), format_action(Action.move(2))] * max_turns  # never stops
    records = [_play(mazes[0], max_turns, wander)]
    solvable = [m for m in mazes[1:] if m.solvable_within(max_turns)]
    assert solvable, "the synthetic eval needs a maze solvable within max_turns"
    if solved:
        records.append(_play(solvable[0], max_turns, [format_action(a) for a in solver_actions(solvable[0])]))
    n = len(records)
    n_solved = sum(r["outcome"] == "solved" for r in records)
    return {
        "num_mazes": n,
        "solve_rate": n_solved / n,
        "solved": n_solved,
        "solvable": sum(r["solvable"] for r in records),
        "solvable_bound": sum(r["solvable"] for r in records) / n,
        "mean_turns": sum(r["turns"] for r in records) / n,
        "invalid_action_rate": 0.1,
        "max_turns": max_turns,
        "lora_version": step,
        "step": step,
        "mazes": records,
    }


def _step_metrics(step: int, rollout: float) -> dict:
    return {
        "step": step,
        "rollout_solve_rate": rollout,
        "rollout_reward_mean": rollout,
        "time_rollout_s": 2.0,
        "time_train_s": 1.0,
        "time_sync_s": 0.5,
        "time_checkpoint_s": 0.5,
        "time_step_s": 4.0 if step % 4 else 6.0,
        "lora_version": step,
        "recoveries": 0,
        "checkpoint_age_steps": step % 4,
    }


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    cfg = tiny_config("run_name=synthetic")
    run = tmp_path / "synthetic"
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(describe(cfg))
    log = [{"step": 0, "sft_step": 1, "sft_nll": 2.0}]
    for step, solved in ((0, False), (4, True), (8, True)):
        data = _eval_json(cfg, step, solved)
        (run / "eval" / f"eval_step_{step:06d}.json").write_text(json.dumps(data, indent=1))
        if step == 0:
            log.append(
                {"step": 0, "eval_solve_rate": data["solve_rate"], "eval_solvable_bound": data["solvable_bound"]}
            )
    for step in range(1, 7):
        log.append(
            _step_metrics(step, 0.1 * step)
            | ({"eval_solve_rate": 0.5, "eval_solvable_bound": 1.0, "time_eval_s": 1.5} if step == 4 else {})
        )
    log.append({"step": 4, "recoveries": 1, "recovery_at": 123.0})  # lost a node after step 6: back to step 4
    for step in range(5, 8):
        log.append(_step_metrics(step, 0.05 * step) | {"recoveries": 1})
    # step 8's eval JSON exists but the driver has not logged step 8 yet (the evaluator's hook runs first)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in log) + '\n{"step": 9, "torn')
    return run


def test_metrics_by_step_last_entry_wins(run_dir):
    steps = run_files.metrics_by_step(run_dir)
    assert sorted(steps) == list(range(8))
    assert steps[5]["rollout_solve_rate"] == pytest.approx(0.25) and steps[5]["recoveries"] == 1  # the re-run
    assert steps[4]["eval_solve_rate"] == 0.5 and steps[4]["recoveries"] == 1  # partial records merge
    assert steps[0]["sft_step"] == 1 and "eval_solve_rate" in steps[0]
    history = run_files.eval_history(run_dir, steps)
    assert [h["step"] for h in history] == [0, 4, 8]
    assert history[-1]["solve_rate"] == pytest.approx(0.5) and history[0]["solve_rate"] == 0


def test_after_eval_writes_plot_and_replay(run_dir):
    written = report.after_eval(run_dir, 8)
    assert written["plot"] == run_dir / "eval" / "solve_rate.png"
    assert written["replay"] == run_dir / "eval" / "replay_step_000008.gif"
    with Image.open(written["plot"]) as png:
        assert png.format == "PNG" and png.size == (800, 450)

    cfg = tiny_config()
    episode = json.loads((run_dir / "eval" / "eval_step_000008.json").read_text())["mazes"][1]
    assert episode["outcome"] == "solved"  # the replay picks the solved episode, not the first
    with Image.open(written["replay"]) as gif:
        assert gif.format == "GIF"
        assert gif.n_frames == episode["turns"] + 1
        width, height = replay.replay_frame_size(cfg.maze.size, cfg.maze.cell_px)
        assert gif.size == (width, height) and height == width + replay.CAPTION_PX
        scale = replay.replay_scale(cfg.maze.size * cfg.maze.cell_px)
        maze = generate_maze(episode["seed"], cfg.maze.size)

        def agent_at(cell) -> bool:  # the agent's blue disc at the cell's centre
            centre = ((cell[1] + 0.5) * cfg.maze.cell_px * scale, (cell[0] + 0.5) * cfg.maze.cell_px * scale)
            rgb = gif.convert("RGB").getpixel((int(centre[0]), int(centre[1])))
            return all(abs(a - b) <= 8 for a, b in zip(rgb, AGENT_RGB))

        gif.seek(0)
        assert agent_at(maze.start) and not agent_at(maze.goal)
        gif.seek(gif.n_frames - 1)
        assert agent_at(maze.goal)
        caption = gif.convert("RGB").crop((0, height - replay.CAPTION_PX, width, height))
        assert caption.getextrema()[0][1] > 200  # there is light text on the dark strip

    # the first eval has no solved episode: its replay is the first one, played to the end of the budget
    report.after_eval(run_dir, 0)
    with Image.open(run_dir / "eval" / "replay_step_000000.gif") as gif:
        assert gif.n_frames == cfg.rollout.max_turns + 1


def test_build_report(run_dir):
    path = report.build_report(run_dir)
    assert path == run_dir / "report.html"
    page = path.read_text()
    assert "synthetic" in page and "Steps recorded: 7 of 8." in page
    assert 'src="eval/solve_rate.png"' in page and 'src="eval/replay_step_000008.gif"' in page
    assert (run_dir / "eval" / "replay_step_000008.gif").is_file()
    assert "50.0%" in page  # final and best eval solve rate
    for step in (0, 4, 8):
        assert f"<td>{step}</td>" in page
    assert "Step anatomy" in page and "rollout" in page and "checkpoint" in page
    assert "maze.size" in page and "rollout.max_turns" in page
    anatomy = dict(
        (phase, (mean, share)) for phase, mean, share in report.step_anatomy(run_files.metrics_by_step(run_dir))
    )
    assert anatomy["rollout"][0] == pytest.approx(2.0) and anatomy["step"][1] == 1.0
    assert anatomy["eval"][0] == pytest.approx(1.5 / 7)


def test_script(run_dir):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT.parent,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(run_dir / "report.html")
    missing = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), str(run_dir / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no run folder" in missing.stderr


def test_after_eval_never_raises(tmp_path, caplog):
    assert report.after_eval(tmp_path / "does-not-exist" / "x", 4) == {}
    assert not (tmp_path / "does-not-exist").exists()
    broken = tmp_path / "broken"
    (broken / "eval").mkdir(parents=True)
    (broken / "config.yaml").write_text("maze: [unclosed\n")
    (broken / "metrics.jsonl").write_text('not json\n{"step": "x"}\n')
    (broken / "eval" / "eval_step_000004.json").write_text("{ torn")
    assert "replay" not in report.after_eval(broken, 4)
    (broken / "eval" / "eval_step_000004.json").write_text(json.dumps({"mazes": []}))
    assert "replay" not in report.after_eval(broken, 4)
    (broken / "eval" / "eval_step_000004.json").write_text(json.dumps({"mazes": [{"seed": "nan", "actions": 3}]}))
    assert "replay" not in report.after_eval(broken, 4)
    assert report.after_eval(broken, "not a step") is not None
    assert any("failed" in r.message for r in caplog.records)
    assert report.build_report(broken).is_file()  # the page still comes out, with what there is
