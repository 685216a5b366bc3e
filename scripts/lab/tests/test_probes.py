"""The perception probe (can a model learn to see walls?) and the update-size measurement, at CPU size."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = os.path.join(ROOT, "tests", "tiny.yaml")


@pytest.fixture(scope="module")
def batch(hf_engine, codec):
    """Two groups of four sampled episodes, rewarded 1 and 0 alternately so that every group carries signal."""
    from app.rollout.engines.base import Sampling
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    requests = [EpisodeRequest(generate_maze(group, 7), group, s) for group in range(2) for s in range(4)]
    settings = EpisodeSettings(max_turns=2, maze_size=7, cell_px=32, image_history=0, max_model_len=4096)
    trajectories = play_episodes(hf_engine, codec, requests, settings, Sampling(8, 1.0, seed=3))
    return [dataclasses.replace(t, reward=float(t.sample % 2)) for t in trajectories]


def test_perception_probe_trains_on_questions_and_scores_held_out_ones(tmp_path, tiny_model_dir, capsys):
    from scripts.lab.perception_probe import main as probe_main

    out = tmp_path / "probe.jsonl"
    overrides = [f"output_dir={tmp_path}", "eval.num_mazes=4", "maze.size=7", "maze.cell_px=8", "rollout.max_turns=20"]
    saved = tmp_path / "seeing"
    assert (
        probe_main(
            [
                TINY,
                str(out),
                *overrides,
                "--steps",
                "3",
                "--batch",
                "4",
                "--eval-every",
                "2",
                "--device",
                "cpu",
                "--rooms",
                "0.75",
                "--save",
                str(saved),
            ]
        )
        == 0
    )
    log = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["step"] for e in log] == [2, 3]
    assert all(0.0 <= e["p_exact"] <= 1.0 and 0.0 <= e["answered"] <= 1.0 and e["heldout_nll"] > 0 for e in log)
    for e in log:  # the score split by where the agent stands; the held-out questions have both kinds or one
        parts = [p for p in (e["p_exact_room"], e["p_exact_passage"]) if p is not None]
        assert parts and min(parts) <= e["p_exact"] + 1e-9 and e["p_exact"] <= max(parts) + 1e-9
    assert probe_main([TINY, str(out), "sft.noise=2"]) == 2  # a bad config is one clear error
    # --stop-above ends at the first evaluation past it (any p > 1e-30); flags may sit between the overrides
    again = tmp_path / "again.jsonl"
    assert (
        probe_main(
            [
                TINY,
                str(again),
                overrides[0],
                "--stop-above",
                "1e-30",
                *overrides[1:],
                "--steps",
                "9",
                "--batch",
                "2",
                "--eval-every",
                "1",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert [json.loads(line)["step"] for line in again.read_text().splitlines()] == [1]

    # The saved model is a model folder that the diagnosis (and scripts/sft.py, model.path=) plays
    from scripts.diagnose import main as diagnose_main

    assert (
        diagnose_main([TINY, str(saved), *overrides[:4], "rollout.max_turns=9", "--questions", "--device", "cpu"]) == 0
    )
    played = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert played["mazes"] == 4 and played["questions"] == 4 and 0 <= played["open_moves_per_neighbour"] <= 1
    assert played["turns"] <= 36 and sum(v for k, v in played.items() if k.startswith("share_")) == pytest.approx(1)


def test_the_probe_asks_in_rooms_or_passages_as_told(tmp_path, capsys):
    import numpy as np

    from app.world.maze import generate_maze, is_room
    from scripts.lab.perception_probe import cell_to_ask
    from scripts.lab.perception_probe import main as probe_main

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


def test_update_size_script_measures_more_drift_at_a_higher_rate(tiny_model_dir, batch, tmp_path):
    """scripts/lab/update_size.py's measurement, on the same rewarded batch: rows per rate, drift growing with it."""
    from scripts.lab.update_size import measure

    config = TINY
    out = tmp_path / "sizes.jsonl"
    rows = measure(
        config, ["train.micro_batch=8", "train.update_epochs=2"], tiny_model_dir, batch, [1e-5, 0.05], "cpu", out
    )
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    gentle, bold = rows
    assert 0.0 < gentle["step_kl"] < bold["step_kl"] and gentle["update_kl"] < bold["update_kl"]
    assert gentle["moved_10pct"] <= bold["moved_10pct"] and bold["moved_10pct"] > 0.0
    assert all(r["groups"] == 2 and r["zero_variance_groups"] == 0 for r in rows)
