"""app.observe.evaluation: what the sampled held-out play reports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.observe.evaluation import sampled_report, sampled_sampling


def test_sampled_report_counts_every_sample_and_each_maze_solved_at_least_once():
    played = [
        SimpleNamespace(group=g, solved=s)
        for g, s in [(0, True), (0, False), (1, False), (1, False), (2, True), (2, True)]
    ]
    report = sampled_report(played, samples=2, temperature=0.7)
    assert report == {
        "sampled_samples": 2,
        "sampled_temperature": 0.7,
        "sampled_solve_rate": pytest.approx(3 / 6),
        "sampled_pass_at_k": pytest.approx(2 / 3),
    }
    assert sampled_report([], 2, 0.7)["sampled_solve_rate"] == 0.0


def test_sampled_play_uses_the_rollout_temperature_and_one_seed_per_held_out_set():
    from app.config import load_config

    cfg = load_config("tests/tiny.yaml", ["rollout.temperature=0.7", "eval.samples=4"])
    sampling = sampled_sampling(cfg)
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, cfg.rollout.top_p, cfg.eval.seed + 1)
    assert sampled_sampling(cfg) == sampling  # every evaluation of a run draws alike
