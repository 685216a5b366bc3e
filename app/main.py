"""The entry point and the driver loop: `python -m app.main CONFIG [key=value ...] [--plan]`.

The driver holds only object refs and small metric dicts; trajectories, adapters and optimizer state
travel between actors through the object store. One step: rollout -> engines sleep -> train -> LoRA
sync -> engines wake -> (eval) -> (export, checkpoint) -> metrics. When an actor or a node is lost, the
driver releases everything, waits for resources, re-creates the actors and resumes from the newest
complete checkpoint, at most checkpoint.max_failures times.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

import ray

from app.config import Config, ConfigError, absolute_paths, describe, load_config
from app.driver.cluster import Actors, connect_ray, recoverable_errors, shutdown, spawn
from app.driver.phases import merge_rollout, prefixed, rollout_phase, sampling_phase, sync_lora, timed
from app.observe.metrics import MetricsSink
from app.observe.report import build_report
from app.world.sampler import MazeSampler, eval_mazes
from placement import plan as placement

log = logging.getLogger("mazerl")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m app.main", description="mazerl: multi-turn GRPO on visual mazes")
    ap.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="dotted overrides such as train.lr=1e-5")
    ap.add_argument("--plan", action="store_true", help="print the validated config and placement, start nothing")
    ap.add_argument(
        "--cluster",
        help="with --plan: a cluster to place on instead of none, e.g. 'head:CPU=32,head=1;3x worker:GPU=2,CPU=32'",
    )
    return ap.parse_args(argv)


class Run:
    """The state the driver carries across steps and across recoveries."""

    def __init__(self, cfg: Config, sampler: MazeSampler, sink):
        self.cfg, self.sampler, self.sink = cfg, sampler, sink
        self.recoveries = 0
        self.last_checkpoint = 0
        self.history: list[dict] = []

    def json_state(self, trainer_state: dict) -> dict:
        return {
            "trainer": trainer_state,
            "sampler": self.sampler.state_dict(),
            "recoveries": self.recoveries,
            "metrics_history": self.history,
            "config": asdict(self.cfg),
        }


def restore(run: Run, actors: Actors) -> int:
    """Resume from a checkpoint, or start fresh (with the warm start); returns the step to continue after."""

    cfg = run.cfg
    summary_ref, saved_ref = actors.consolidator.resume.remote()
    summary = ray.get(summary_ref)
    ray.get([t.load_state.remote(saved_ref) for t in actors.trainers])
    step = summary["step"]
    if step:
        state = summary["state"]
        run.sampler.load_state_dict(state["sampler"])
        run.history = state["metrics_history"]
        run.last_checkpoint = step
        log.info("resuming from checkpoint %s (step %d)", summary["location"], step)
    else:
        log.info("no checkpoint to resume from (resume_mode %s): starting at step 0", cfg.checkpoint.resume_mode)
    if not step and cfg.sft.steps and not cfg.model.adapter_init:
        for k in range(1, cfg.sft.steps + 1):
            seeds = [m.seed for m in run.sampler.next(cfg.sft.mazes_per_step)]
            run.sink.record(
                0, {"sft_step": k, **ray.get([t.sft_step.remote(seeds, cfg.sft.lr) for t in actors.trainers])[0]}
            )
    sync_lora(actors, [t.lora.remote() for t in actors.trainers][0], step)
    if cfg.eval.at_start and not step:
        run.sink.record(0, prefixed("eval", ray.get(actors.evaluator.evaluate.remote(0))))
    return step


def save(run: Run, actors: Actors, step: int, lora_ref) -> dict:
    """Exports the adapter and writes the full checkpoint when their intervals come due."""

    ck, out = run.cfg.checkpoint, {}
    if ck.hf_save_interval and step % ck.hf_save_interval == 0:
        out.update(ray.get(actors.consolidator.export_adapter.remote(step, lora_ref)))
    if ck.ckpt_interval and (step % ck.ckpt_interval == 0 or step == run.cfg.total_steps):
        adapter, optimizer, rng, trainer_state = zip(*[t.checkpoint_state.remote() for t in actors.trainers])
        info = ray.get(
            actors.consolidator.save_checkpoint.remote(
                step, adapter[0], optimizer[0], rng[0], run.json_state(ray.get(trainer_state[0]))
            )
        )
        run.last_checkpoint = step
        out.update({k: v for k, v in info.items() if k != "name"})
    return out


def run_steps(run: Run, actors: Actors, start: int) -> None:

    cfg = run.cfg
    for step in range(start + 1, cfg.total_steps + 1):
        times: dict = {}
        with timed(times, "rollout"):
            summaries, trajectory_refs, sampling = sampling_phase(
                lambda mazes, round_, step=step: rollout_phase(actors, mazes, cfg, step, round_), run.sampler, cfg.train
            )
        ray.get([a.sleep.remote() for a in actors.rollouts])
        with timed(times, "train"):
            results = [t.step.remote(trajectory_refs, step) for t in actors.trainers]
            train_metrics = ray.get([m for m, _ in results])[0]
        with timed(times, "sync"):
            sync_lora(actors, results[0][1], step)
        metrics = {**merge_rollout(summaries, times["time_rollout_s"]), **sampling, **prefixed("train", train_metrics)}
        if cfg.eval.eval_interval and (step % cfg.eval.eval_interval == 0 or step == cfg.total_steps):
            with timed(times, "eval"):
                metrics.update(prefixed("eval", ray.get(actors.evaluator.evaluate.remote(step))))
        with timed(times, "checkpoint"):
            metrics.update(save(run, actors, step, results[0][1]))
        times["time_step_s"] = sum(times.values())
        metrics.update(
            times, lora_version=step, recoveries=run.recoveries, checkpoint_age_steps=step - run.last_checkpoint
        )
        run.history.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))} | {"step": step})
        run.sink.record(step, metrics)


def write_report(run_dir: Path) -> None:
    """The one-page HTML report with the curve and a replay; a failure here never fails the run."""
    try:
        log.info("report: %s", build_report(run_dir))
    except Exception:
        log.warning("building the run report failed", exc_info=True)


def train(cfg: Config, plan: placement.Plan, sampler: MazeSampler) -> int:

    run_dir = Path(cfg.output_dir) / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(describe(cfg))
    run = Run(
        cfg,
        sampler,
        MetricsSink(run_dir, cfg.run_name, cfg.total_steps, cfg.metrics.prometheus, cfg.metrics.progress_bar),
    )
    try:
        while True:
            actors = None
            try:
                actors = spawn(cfg, plan)
                run_steps(run, actors, restore(run, actors))
                write_report(run_dir)
                return 0
            except recoverable_errors() as e:
                run.recoveries += 1
                if run.recoveries > cfg.checkpoint.max_failures:
                    log.error("giving up after %d recoveries: %s", run.recoveries - 1, e)
                    raise
                log.warning(
                    "lost an actor or node (%s: %s); recovery %d of %d from the latest checkpoint",
                    type(e).__name__,
                    str(e).splitlines()[0][:200],
                    run.recoveries,
                    cfg.checkpoint.max_failures,
                )
                run.sink.record(run.last_checkpoint, {"recoveries": run.recoveries, "recovery_at": time.time()})
            finally:
                if actors is not None:
                    shutdown(actors)
    finally:
        run.sink.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        cfg = absolute_paths(load_config(args.config, args.overrides, check_paths=not args.plan or not args.cluster))
        plan = placement.make_plan(cfg)
        if args.plan:
            print(describe(cfg))
            nodes = placement.parse_cluster(args.cluster) if args.cluster else []
            print(placement.describe(plan, {k: v for _, r in nodes for k, v in r.items()}))
            if nodes:
                print(f"on the described cluster ({len(nodes)} nodes, PACK):")
                for i, node in enumerate(placement.simulate(plan, nodes)):
                    print(f"  bundle {i} -> {node}")
                head = next((n for n, r in nodes if r.get(placement.HEAD_RESOURCE)), nodes[0][0])
                print(f"  consolidator -> {head}")
            return 0
        eval_ids = {m.identity for m in eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)}
        sampler = MazeSampler(
            cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, eval_ids, random_starts=cfg.train.random_starts
        )
        ray = connect_ray(cfg)
        placement.check_cluster(plan, ray.cluster_resources())
    except ConfigError as e:
        print(f"mazerl: {e}", file=sys.stderr)
        return 2
    return train(cfg, plan, sampler)


if __name__ == "__main__":
    sys.exit(main())
