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
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from app.config import Config, ConfigError, absolute_paths, describe, load_config
from app.driver.cluster import Actors, connect_ray, ray_dashboard, recoverable_errors, shutdown, spawn
from app.driver.phases import (
    evaluate,
    export_adapter,
    flush_replicas,
    merge_rollout,
    prefixed,
    rollout_phase,
    sampling_phase,
    sleep_engines,
    sync_lora,
    timed,
    train_phase,
    validate,
    warm_start_step,
    write_checkpoint,
)
from app.driver.preflight import (
    check_context_budget,
    check_resume,
    check_storage,
    describe_preflight,
    model_flops,
)
from app.driver.waits import Waits, fetch_failed_returns
from app.observe.efficiency import peak_tflops, step_efficiency
from app.observe.metrics import MetricsSink
from app.observe.report import build_report
from app.observe.summary import build_summary, write_summary
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
    return ap.parse_intermixed_args(argv)  # --plan may come anywhere, before or after the overrides


class Run:
    """The state the driver carries across steps and across recoveries."""

    def __init__(self, cfg: Config, sampler: MazeSampler, sink):
        self.cfg, self.sampler, self.sink = cfg, sampler, sink
        self.waits = Waits(cfg.waits)
        self.flops = model_flops(cfg)
        self.recoveries = 0
        self.last_checkpoint = 0
        self.restored = False  # whether this job got as far as restore() once: last_checkpoint is known
        self.saved_steps: list[int] = []  # the checkpoints this run committed: a recovery resumes from the newest
        self.start_sampler = sampler.state_dict()  # where the run began, for a recovery before any checkpoint
        # just past the newest trained step's mazes, not those played ahead: where a checkpoint resumes
        self.sampler_at_step = sampler.state_dict()
        self.history: list[dict] = []

    def efficiency(self, metrics: dict, actors: Actors) -> dict:
        """Each phase's FLOPs, MFU and floor (app/observe/efficiency.py) on this run's GPUs."""
        p = self.cfg.placement
        peak = peak_tflops(actors.device_name, self.cfg.metrics.peak_tflops)
        gpus = p.num_bundles * p.gpus_per_bundle
        return step_efficiency(metrics, self.flops, gpus, peak, self.cfg.model.recomputed_share)

    def json_state(self, trainer_state: dict) -> dict:
        return {
            "trainer": trainer_state,
            "sampler": self.sampler_at_step,
            "recoveries": self.recoveries,
            "metrics_history": self.history,
            "config": asdict(self.cfg),
        }


def restore(run: Run, actors: Actors) -> int:
    """Resume from a checkpoint, or start fresh (with the warm start); returns the step to continue after.

    A recovery resumes from the newest checkpoint this run committed, whatever checkpoint.resume_mode says (it
    chose the run's start); before the first one, from the run's start again, sampler and history included."""
    cfg = run.cfg
    waits = run.waits
    summary_ref, saved_ref = actors.consolidator.resume.remote(run.saved_steps)
    try:
        summary = waits.one(summary_ref, "restore", actors.label("consolidator"))
    except BaseException:
        fetch_failed_returns([(summary_ref, saved_ref)])
        raise
    waits.gather([t.load_state.remote(saved_ref) for t in actors.trainers], "restore", actors.trainer_names)
    step = summary["step"]
    run.restored = True
    if step:
        state = summary["state"]
        run.sampler.load_state_dict(state["sampler"])
        run.history = state["metrics_history"]
        run.last_checkpoint = step
        log.info("resuming from checkpoint %s (step %d)", summary["location"], step)
    else:
        run.sampler.load_state_dict(run.start_sampler)
        run.history, run.last_checkpoint = [], 0
        log.info("no checkpoint to resume from (resume_mode %s): starting at step 0", cfg.checkpoint.resume_mode)
    if not step and cfg.sft.steps and not cfg.model.adapter_init:
        warm_start(run, actors)
    sync_lora(actors, [t.lora.remote() for t in actors.trainers][0], step, waits)
    if cfg.eval.at_start and not step:
        run.sink.record(0, evaluate(actors, 0, waits))
    return step


def warm_start(run: Run, actors: Actors) -> None:
    """Supervised steps on the BFS solver's demonstrations before GRPO. With sft.target_solve_rate they go on, after
    sft.steps, until the greedy policy solves that share of validation mazes (training mazes set aside, never the
    held-out ones): where SFT starts to solve varies with the seed, and GRPO learns only from groups that sometimes
    solve."""
    sft, waits = run.cfg.sft, run.waits
    target = sft.target_solve_rate
    validation = run.sampler.next(sft.validation_mazes) if target else []
    most = (sft.max_steps or 4 * sft.steps) if target else sft.steps
    for k in range(1, most + 1):
        seeds = [m.seed for m in run.sampler.next(sft.mazes_per_step)]
        record = {"sft_step": k, "sft_most": most, **warm_start_step(actors, seeds, sft.lr, waits)}
        done = False
        if target and k >= sft.steps and (k - sft.steps) % sft.check_every == 0:
            sync_lora(actors, [t.lora.remote() for t in actors.trainers][0], 0, waits)
            report = validate(actors, validation, waits)
            record.update(prefixed("sft_validation", report), sft_target=target)
            done = report["solve_rate"] >= target and report["invalid_action_rate"] <= sft.max_invalid_rate
        run.sink.record(0, record)
        if done:
            break


def save(run: Run, actors: Actors, step: int, lora_ref) -> dict:
    """Exports the adapter and writes the full checkpoint when their intervals come due."""
    ck, out = run.cfg.checkpoint, {}
    if ck.hf_save_interval and step % ck.hf_save_interval == 0:
        out.update(export_adapter(actors, step, lora_ref, run.waits))
    if ck.ckpt_interval and (step % ck.ckpt_interval == 0 or step == run.cfg.total_steps):
        info = write_checkpoint(actors, step, run.json_state, run.waits)
        run.last_checkpoint = step
        run.saved_steps.append(step)
        out.update({k: v for k, v in info.items() if k != "name"})
    return out


@dataclass
class Played:
    """One step's rollouts: what the trainers take, what the step reports, and the sampler just past its mazes."""

    summaries: list[dict]
    trajectory_refs: list
    sampling: dict
    seconds: float
    sampler_state: dict


def play(run: Run, actors: Actors, step: int) -> Played:
    """The step's rollouts, dynamic sampling's refill rounds included."""
    cfg, started = run.cfg, time.perf_counter()
    summaries, refs, sampling = sampling_phase(
        lambda mazes, round_: rollout_phase(actors, mazes, cfg, step, round_, run.waits), run.sampler, cfg.train
    )
    return Played(summaries, refs, sampling, time.perf_counter() - started, run.sampler.state_dict())


def run_steps(run: Run, actors: Actors, start: int) -> None:
    """The GRPO steps. With rollout.play_ahead, step k+1's rollouts play while step k trains: the engines hold
    adapter k-1 then, so each batch from the second step on trains one version after the adapter that played it.
    A step's time_rollout_s is its batch's, played during the previous step's train phase when played ahead."""
    cfg, waits = run.cfg, run.waits
    ahead = None  # the next step's rollouts, played while this step trained
    for step in range(start + 1, cfg.total_steps + 1):
        times: dict = {}
        if ahead is None:
            with timed(times, "rollout"):
                played = play(run, actors, step)
        else:
            played = ahead
        sleep_engines(actors, waits)
        meanwhile = partial(play, run, actors, step + 1) if cfg.rollout.play_ahead and step < cfg.total_steps else None
        with timed(times, "train"):
            train_metrics, lora_ref, ahead = train_phase(actors, played.trajectory_refs, step, waits, meanwhile)
        with timed(times, "sync"):
            sync_lora(actors, lora_ref, step, waits)
        metrics = {**merge_rollout(played.summaries, played.seconds), **played.sampling}
        metrics.update(prefixed("train", train_metrics))
        if step == cfg.total_steps or (cfg.eval.eval_interval and step % cfg.eval.eval_interval == 0):
            with timed(times, "eval"):
                metrics.update(evaluate(actors, step, waits))
        run.sampler_at_step = played.sampler_state
        with timed(times, "checkpoint"):
            metrics.update(save(run, actors, step, lora_ref))
        times["time_step_s"] = sum(times.values())
        times["time_rollout_s"] = played.seconds
        metrics.update(times, lora_version=step, recoveries=run.recoveries, stalls=waits.stalls)
        metrics.update(checkpoint_age_steps=step - run.last_checkpoint, **run.efficiency(metrics, actors))
        run.history.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))} | {"step": step})
        run.sink.record(step, metrics)


def where_it_resumes(run: Run) -> str:
    """Where a resubmitted job goes on from. A job that failed before restore() every time never read the
    checkpoints, so its own count (0) says nothing of those an earlier job left: they are looked up."""
    if run.restored and run.last_checkpoint:
        return f"The newest checkpoint is step {run.last_checkpoint}; submitting the job again resumes from it."
    if run.restored:
        return "The job made no checkpoint: submitting it again starts it over."
    try:
        location = check_resume(run.cfg)
    except Exception as e:  # a storage or config error here must not hide the error the job gives up on
        return f"This job never reached its checkpoints, and looking them up failed ({e})."
    if location is None:
        mode = run.cfg.checkpoint.resume_mode
        return f"This job never reached its checkpoints; with checkpoint.resume_mode={mode} none resumes."
    return f"This job never reached its checkpoints; submitting the job again resumes from {location}."


def write_report(run_dir: Path) -> None:
    """The one-page HTML report with the curve and a replay; a failure here never fails the run."""
    try:
        log.info("report: %s", build_report(run_dir))
    except Exception:
        log.warning("building the run report failed", exc_info=True)


def train(cfg: Config, plan: placement.Plan, sampler: MazeSampler, args: argparse.Namespace) -> int:
    started_at = time.time()

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
                actors = spawn(cfg, plan, run.waits)
                run_steps(run, actors, restore(run, actors))
                flush_replicas(actors, run.waits)
                write_report(run_dir)
                summary = build_summary(
                    run_dir, started_at, time.time(), args.config, args.overrides, cfg.model.path, ray_dashboard()
                )
                print("\n" + summary, flush=True)
                log.info("summary: %s", write_summary(run_dir, summary))
                return 0
            except ConfigError as e:  # one a run meets only once it runs (a trainer out of GPU memory): no retry
                print(f"mazerl: {getattr(e, 'cause', e)}", file=sys.stderr)
                return 2
            except recoverable_errors() as e:
                run.recoveries += 1
                if run.recoveries > cfg.checkpoint.max_failures:
                    log.error(
                        "giving up after %d recoveries (checkpoint.max_failures): %s: %s. %s",
                        run.recoveries - 1,
                        type(e).__name__,
                        str(e).splitlines()[0][:300],
                        where_it_resumes(run),
                    )
                    return 1
                log.warning(
                    "lost an actor or node (%s: %s); recovery %d of %d, from this run's newest checkpoint",
                    type(e).__name__,
                    str(e).splitlines()[0][:200],
                    run.recoveries,
                    cfg.checkpoint.max_failures,
                )
                run.sink.record(
                    run.last_checkpoint,
                    {"recoveries": run.recoveries, "stalls": run.waits.stalls, "recovery_at": time.time()},
                )
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
            print("\n".join(describe_preflight(cfg)))
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
        check_storage(cfg)
        check_resume(cfg)
        check_context_budget(cfg)
        ray = connect_ray(cfg)
        placement.check_cluster(plan, ray.cluster_resources())
    except ConfigError as e:
        print(f"mazerl: {e}", file=sys.stderr)
        return 2
    return train(cfg, plan, sampler, args)


if __name__ == "__main__":
    sys.exit(main())
