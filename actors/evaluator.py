"""EvaluatorActor: the fixed held-out mazes, played greedily (and, with eval.samples, sampled) through the rollouts."""

from __future__ import annotations

import json
from pathlib import Path

import ray

from app.config import Config
from app.observe.evaluation import eval_report, sampled_report, sampled_sampling
from app.rollout.engines import Sampling
from app.world.diagnosis import diagnosis_metrics
from app.world.sampler import eval_mazes


@ray.remote
class EvaluatorActor:
    def __init__(self, cfg: Config, out_dir: str):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)

    def identities(self) -> list[str]:
        return [m.identity for m in self.mazes]

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def validate(self, mazes: list, rollouts: list) -> dict:
        """The greedy summary on these training mazes (the warm start's validation set); nothing is written."""
        trajectories = self._play(mazes, rollouts, 1, self._greedy())
        return {k: v for k, v in eval_report(trajectories, self.cfg.rollout.max_turns).items() if k != "mazes"}

    def _greedy(self) -> Sampling:
        return Sampling(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0)

    def _play(self, mazes: list, rollouts: list, samples: int, sampling: Sampling) -> list:
        """Each maze played `samples` times, the mazes shared round-robin over the rollout actors; by maze."""
        shares = [[(maze, i) for i, maze in enumerate(mazes) if i % len(rollouts) == k] for k in range(len(rollouts))]
        refs = [actor.play.remote(share, samples, sampling)[1] for actor, share in zip(rollouts, shares) if share]
        return sorted((t for batch in ray.get(refs) for t in batch), key=lambda t: t.group)

    def evaluate(self, step: int, rollouts: list) -> dict:
        """Plays every held-out maze once, greedily (and eval.samples times sampled), through these rollout actors;
        writes per-maze outcomes of the greedy play; returns the summary."""
        trajectories = self._play(self.mazes, rollouts, 1, self._greedy())
        report = eval_report(trajectories, self.cfg.rollout.max_turns)
        report.update(diagnosis_metrics(report, self.cfg.maze.size), step=step)
        if self.cfg.eval.samples:
            sampled = self._play(self.mazes, rollouts, self.cfg.eval.samples, sampled_sampling(self.cfg))
            report.update(sampled_report(sampled, self.cfg.eval.samples, self.cfg.rollout.temperature))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"eval_step_{step:06d}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)

        # imported here, not at start: matplotlib is seconds of CPU on the start's critical path
        from app.observe.report import after_eval

        after_eval(self.out_dir.parent, step)  # eval/solve_rate.png + eval/replay_step_NNNNNN.gif; never raises
        return {k: v for k, v in report.items() if k != "mazes"}
