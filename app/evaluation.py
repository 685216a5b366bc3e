"""What an evaluation reports: the true solve rate and the bound the turn budget puts on it."""

from __future__ import annotations

from app.trajectory import Trajectory


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
        "max_turns": max_turns,
        "lora_version": max((t.lora_version for t in trajectories), default=-1),
        "mazes": [{"seed": t.maze_seed, "maze_id": t.maze_id, "outcome": t.outcome, "turns": t.turns,
                   "moves": t.moves, "optimal_moves": t.optimal_moves, "solvable": t.solvable,
                   "invalid_actions": t.invalid_actions, "actions": t.actions} for t in trajectories],
    }


def play_held_out(cfg, engine) -> dict:
    """The held-out mazes played greedily in this process with `engine` (no Ray): `eval_report` plus the
    `why_*` turn classes (app.diagnosis), as the evaluator actor writes them."""
    from app.diagnosis import diagnosis_metrics
    from app.engines.base import Sampling
    from app.episodes import EpisodeRequest, episode_settings, play_episodes
    from app.sampler import eval_mazes

    mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    played = play_episodes(engine, engine.codec, [EpisodeRequest(m, i) for i, m in enumerate(mazes)],
                           episode_settings(cfg), Sampling(cfg.rollout.max_new_tokens, 0.0))
    report = eval_report(played, cfg.rollout.max_turns)
    report.update(diagnosis_metrics(report, cfg.maze.size))
    return report
