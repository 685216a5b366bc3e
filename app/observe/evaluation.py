"""What an evaluation reports: the true solve rate and the bound the turn budget puts on it."""

from __future__ import annotations

from app.rollout.engines.base import Sampling
from app.rollout.trajectory import Trajectory
from app.world.diagnosis import diagnosis_metrics
from app.world.rules import EpisodeSettings
from app.world.sampler import eval_mazes


def eval_report(trajectories: list[Trajectory], max_turns: int) -> dict:
    """Summary + per-maze outcomes. `solve_rate` counts only stop-on-goal within the turn budget."""
    n = max(len(trajectories), 1)
    solvable = sum(t.solvable for t in trajectories)
    solved = sum(t.solved for t in trajectories)
    turns = sum(t.turns for t in trajectories)
    return {
        "num_mazes": len(trajectories),
        "solve_rate": solved / n,
        "solved": solved,
        "solvable": solvable,
        "solvable_bound": solvable / n,
        "solve_rate_of_solvable": solved / max(solvable, 1),
        "mean_turns": turns / n,
        "mean_turns_solved": sum(t.turns for t in trajectories if t.solved) / max(solved, 1),
        "invalid_action_rate": sum(t.invalid_actions for t in trajectories) / max(turns, 1),
        "stopped_off_goal": sum(t.outcome == "stopped_off_goal" for t in trajectories),
        "out_of_turns": sum(t.outcome == "out_of_turns" for t in trajectories),
        "context_full": sum(t.outcome == "context_full" for t in trajectories),
        "max_turns": max_turns,
        "lora_version": max((t.lora_version for t in trajectories), default=-1),
        "mazes": [
            {
                "seed": t.maze_seed,
                "maze_id": t.maze_id,
                "outcome": t.outcome,
                "turns": t.turns,
                "moves": t.moves,
                "optimal_moves": t.optimal_moves,
                "solvable": t.solvable,
                "invalid_actions": t.invalid_actions,
                "actions": t.actions,
            }
            for t in trajectories
        ],
    }


def sampled_report(trajectories: list[Trajectory], samples: int, temperature: float) -> dict:
    """The held-out mazes played `samples` times each at the rollout temperature, summarised.

    Greedy play shows the policy's mode, and a mode that loops hides what the policy GRPO trains (the sampled
    one) has learned: sampled_solve_rate is that policy's true solve rate, sampled_pass_at_k the share of mazes
    solved by at least one of the samples.
    """
    by_maze: dict[int, list[bool]] = {}
    for t in trajectories:
        by_maze.setdefault(t.group, []).append(t.solved)
    return {
        "sampled_samples": samples,
        "sampled_temperature": temperature,
        "sampled_solve_rate": sum(t.solved for t in trajectories) / max(len(trajectories), 1),
        "sampled_pass_at_k": sum(any(s) for s in by_maze.values()) / max(len(by_maze), 1),
    }


def sampled_sampling(cfg):
    """The sampled evaluation's sampling: the rollouts' temperature and top_p, seeded by the held-out set so
    every evaluation of a run draws alike."""

    return Sampling(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, seed=cfg.eval.seed + 1)


def play_held_out(cfg, engine) -> dict:
    """The held-out mazes played greedily in this process with `engine` (no Ray): `eval_report` plus the
    `why_*` turn classes (app.world.diagnosis), and with eval.samples the sampled play, as the evaluator actor writes
    them."""
    # here, not at the top: the evaluator actor imports this module at start, and the episodes bring the image
    # processor (transformers, torchvision), seconds of CPU that only play in this process needs
    from app.rollout.episodes import EpisodeRequest, play_episodes

    mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    played = play_episodes(
        engine,
        engine.codec,
        [EpisodeRequest(m, i) for i, m in enumerate(mazes)],
        EpisodeSettings.from_config(cfg),
        Sampling(cfg.rollout.max_new_tokens, 0.0),
    )
    report = eval_report(played, cfg.rollout.max_turns)
    report.update(diagnosis_metrics(report, cfg.maze.size))
    if cfg.eval.samples:
        requests = [EpisodeRequest(m, i, s) for i, m in enumerate(mazes) for s in range(cfg.eval.samples)]
        sampled = play_episodes(engine, engine.codec, requests, EpisodeSettings.from_config(cfg), sampled_sampling(cfg))
        report.update(sampled_report(sampled, cfg.eval.samples, cfg.rollout.temperature))
    return report
