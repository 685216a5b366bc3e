"""SFT warm start, then GRPO, at learning scale on a CPU, in one process (docs/RESULTS.md, "CPU scale").

The project's own pieces in app.main's order: BFS demonstrations and `PolicyTrainer.sft_step` (the warm
start), then GRPO steps of `play_episodes` on the vLLM engine -> `PolicyTrainer.train_step` -> the LoRA loaded
into the engine, on a tiny Qwen3-VL built here (`ensure_model`). The measure is the greedy true solve rate
on the held-out mazes of `eval_mazes`, which neither phase trains on (the test checks every trained maze).

The tiny model cannot learn to see in CPU time, so `scripts/lab/configs/learn_cpu.yaml` turns on the `route`
observation text. The warm start runs SFT until 16 validation mazes (training mazes set aside) are solved
at >= 40% with <= 40% malformed actions: where SFT "clicks" varies with the seed (fixed 40 steps gave 0%,
36%, 50% or 95% held-out), and GRPO cannot start from malformed replies nor show a gain from 95%. Seeded and
single-threaded, a run repeats itself on one machine. Measured on 4 seeds (docs/RESULTS.md): held-out greedy
solve rate +20.3, +25.0, +34.4, +48.4 points after 20 GRPO steps; this config's seed goes 62.5% -> 96.9%
(62/64, the solvable bound). The test asserts issue 4's 20 points.

    python -m tests.learning.test_learning [train.max_steps=10 ...]   # one run, its numbers printed
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "scripts" / "lab" / "configs" / "learn_cpu.yaml"
# The gain GRPO must bring in held-out greedy solve rate (issue 4: 20 points).
MARGIN = 0.20
# The warm start: SFT steps from sft.steps on, checked every CHECK_EVERY on VALIDATION_MAZES training mazes,
# until their greedy solve rate reaches WARM_START_TARGET with at most MAX_INVALID of the actions malformed
# (or MAX_SFT_STEPS).
VALIDATION_MAZES, CHECK_EVERY, WARM_START_TARGET, MAX_INVALID, MAX_SFT_STEPS = 16, 5, 0.4, 0.4, 100


def learn(overrides: list[str] = (), model_cache: str | os.PathLike | None = None, log=print) -> dict:
    """SFT warm start then GRPO, as configured; returns the held-out reports before and after GRPO."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from app.config import load_config
    from app.driver.phases import rollout_seed, sampling_phase
    from app.learning.sft import demonstrations
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.observe.evaluation import eval_report
    from app.rollout.engines import Sampling, make_engine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.rollout.trajectory import summarize
    from app.world.rules import EpisodeSettings
    from app.world.sampler import MazeSampler, eval_mazes

    torch.set_num_threads(1)  # deterministic reductions, and faster than N threads on a shared 2-core box
    t0 = time.perf_counter()
    cfg = load_config(CONFIG, list(overrides))
    model_dir = str(ensure_model(cfg.model, model_cache or Path(cfg.output_dir) / ".models"))
    engine = make_engine(cfg, model_dir)
    trainer = PolicyTrainer(cfg, model_dir)
    settings = EpisodeSettings.from_config(cfg)
    held_out = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    held_out_ids = {m.identity for m in held_out}
    sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, held_out_ids)
    trained_ids: set[str] = set()
    greedy = Sampling(cfg.rollout.max_new_tokens, temperature=0.0)

    def greedy_report(mazes) -> dict:
        requests = [EpisodeRequest(m, i) for i, m in enumerate(mazes)]
        return eval_report(play_episodes(engine, engine.codec, requests, settings, greedy), cfg.rollout.max_turns)

    def evaluate(step: int) -> dict:
        report = greedy_report(held_out)
        log(
            f"eval after step {step}: held-out greedy solve rate {report['solve_rate']:.3f} "
            f"({report['solved']}/{report['num_mazes']}), stopped off goal {report['stopped_off_goal']}, "
            f"out of turns {report['out_of_turns']}, invalid actions {report['invalid_action_rate']:.2f} "
            f"[{time.perf_counter() - t0:.0f}s]"
        )
        return report

    # the warm start (app.main.restore): solver demonstrations of training mazes, from sft.steps on checked
    # every CHECK_EVERY steps on validation mazes (training mazes set aside, never the held-out ones) and
    # stopped once they pass WARM_START_TARGET: the step where SFT "clicks" varies with the seed (25-60 here),
    # and a start that already solves almost everything leaves GRPO nothing to show
    validation = sampler.next(VALIDATION_MAZES)
    trained_ids.update(m.identity for m in validation)
    sft_steps, validation_rate = 0, 0.0
    while sft_steps < MAX_SFT_STEPS:
        sft_steps += 1
        mazes = sampler.next(cfg.sft.mazes_per_step)
        trained_ids.update(m.identity for m in mazes)
        metrics = trainer.sft_step(demonstrations(mazes, trainer.codec, settings), cfg.sft.lr)
        if sft_steps >= cfg.sft.steps and sft_steps % CHECK_EVERY == 0:
            engine.load_lora(trainer.lora_tensors(), sft_steps)
            report = greedy_report(validation)
            validation_rate, validation_invalid = report["solve_rate"], report["invalid_action_rate"]
            log(
                f"sft step {sft_steps}: nll {metrics['sft_nll']:.3f}, validation greedy solve rate "
                f"{validation_rate:.3f}, invalid actions {validation_invalid:.2f} [{time.perf_counter() - t0:.0f}s]"
            )
            if validation_rate >= WARM_START_TARGET and validation_invalid <= MAX_INVALID:
                break
    warm_start = trainer.lora_tensors()
    engine.load_lora(warm_start, 0)
    start = evaluate(0)

    # GRPO (app.main.run_steps): n samples of each maze form a group; one update; the adapter goes to the engine
    steps = []

    def play_round(mazes, round_, step):  # app.driver.phases.rollout_phase, in this process
        trained_ids.update(m.identity for m in mazes)
        n, first = cfg.rollout.n_samples_per_prompt, round_ * len(mazes)
        requests = [EpisodeRequest(m, first + group, s) for group, m in enumerate(mazes) for s in range(n)]
        sampling = Sampling(
            cfg.rollout.max_new_tokens,
            cfg.rollout.temperature,
            cfg.rollout.top_p,
            seed=rollout_seed(cfg.train.seed, step, round_, 0),
        )
        trajectories = play_episodes(engine, engine.codec, requests, settings, sampling)
        return [{"rewards": [(t.group, t.sample, t.reward) for t in trajectories]}], [trajectories]

    for step in range(1, cfg.total_steps + 1):
        _, batches, rounds = sampling_phase(
            lambda mazes, round_, step=step: play_round(mazes, round_, step), sampler, cfg.train
        )
        trajectories = [t for batch in batches for t in batch]
        metrics = trainer.train_step(trajectories)
        engine.load_lora(trainer.lora_tensors(), step)
        rollout = summarize(trajectories)
        steps.append({"step": step, "rollout_solve_rate": rollout["solve_rate"], **rounds, **metrics})
        log(
            f"grpo step {step}: rollout solve rate {rollout['solve_rate']:.3f}, groups with signal "
            f"{metrics['groups'] - metrics['zero_variance_groups']}/{metrics['groups']} "
            f"({rounds['rollout_rounds']} round{'s' if rounds['rollout_rounds'] > 1 else ''}), "
            f"entropy {metrics['entropy']:.3f}, clip {metrics['clip_fraction']:.3f}, "
            f"grad norm {metrics['grad_norm']:.2f}, "
            f"logprob mismatch {metrics['logprob_mismatch_mean']:.1e} [{time.perf_counter() - t0:.0f}s]"
        )
    end = evaluate(cfg.total_steps)
    final = trainer.lora_tensors()
    adapter_change = max(float((final[k] - warm_start[k]).abs().max()) for k in final)
    engine.shutdown()
    return {
        "start": start,
        "end": end,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
        "config": cfg,
        "sft_steps": sft_steps,
        "validation_rate": validation_rate,
        "trained_on_held_out": len(trained_ids & held_out_ids),
        "adapter_change": adapter_change,
    }


@pytest.fixture(scope="module")
def run(model_cache):
    return learn(model_cache=model_cache)


@pytest.mark.slow
@pytest.mark.vllm
def test_sft_warm_start_then_grpo_on_held_out_mazes(run):
    start, end, steps = run["start"], run["end"], run["steps"]
    assert run["trained_on_held_out"] == 0  # neither SFT nor GRPO saw a held-out maze
    assert start["num_mazes"] == end["num_mazes"] == run["config"].eval.num_mazes
    # the warm start emits valid actions but leaves most mazes unsolved (from zero: malformed replies)
    assert run["validation_rate"] >= WARM_START_TARGET and run["sft_steps"] < MAX_SFT_STEPS
    assert start["invalid_action_rate"] < 0.5 and 0.1 <= start["solve_rate"] <= 0.7, start
    assert end["num_mazes"] == 64 and end["invalid_action_rate"] < 1.0  # the GRPO policy still acts
    # GRPO had something to learn from most steps, and moved the adapter
    assert len(steps) == run["config"].total_steps
    assert sum(s["zero_variance_groups"] < s["groups"] for s in steps) >= (len(steps) + 1) // 2
    assert run["adapter_change"] > 0
    # token in, token out: the engine sampled from exactly the policy the trainer scored
    assert max(s["logprob_mismatch_mean"] for s in steps) < 1e-3


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_improves_the_held_out_greedy_solve_rate(run):
    start, end = run["start"]["solve_rate"], run["end"]["solve_rate"]
    assert end - start >= MARGIN, f"held-out greedy solve rate {start:.3f} -> {end:.3f} after GRPO"


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = learn(sys.argv[1:])
    s, e = out["start"], out["end"]
    print(
        f"RESULT {' '.join(sys.argv[1:]) or 'defaults'}: held-out greedy solve rate SFT start "
        f"{s['solve_rate']:.3f} ({s['solved']}/{s['num_mazes']}) -> after GRPO {e['solve_rate']:.3f} "
        f"({e['solved']}/{e['num_mazes']}); rollout solve rate by step "
        f"{[round(x['rollout_solve_rate'], 3) for x in out['steps']]}; {out['seconds']:.0f}s"
    )
