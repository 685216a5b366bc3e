"""Where one GRPO training step's time goes: torch.profiler over a step of the loop's workload (issue 33.2).

One trainer rank alone, as the loop runs it on one GPU (the config's model, LoRA, dtype and checkpointing), trains
on runs shaped like a random-weight model's: every reply `rollout.max_new_tokens` tokens of text that is no action,
so every run lasts `rollout.max_turns` turns (the loop's 8B workload: 121,920 forward tokens for 8 mazes x 8 runs of
h200.yaml at 13 turns), rewards 0/1 at random so every group trains. One warm-up step, TIMED steps timed without
the profiler (their median is the step's time and MFU: the profiler adds its own cost), then STEPS profiled steps.
Prints the steps' times, forward tokens and MFU (as the run reports it: app/observe/efficiency.py) as each step
ends, then the share of the step in forward, backward and the optimizer, the GPU's busy share and the operators
that take the most device time; writes them to OUT/train_profile.txt and, with --trace, the profiled steps' Chrome
trace to OUT/train_trace.json.gz. At 8B the profiler's summary of a whole step takes minutes: profile `--mazes 2`
(the same micro-batches, fewer of them) and time `--mazes 8 --steps 0`.

    python scripts/bench/train_profile.py [--config configs/h200.yaml] [--model PATH] [--mazes 8] [--timed 2] \
        [--steps 1] [--trace] [--device cuda] OUT [key=value ...]

Two settings side by side: two runs of it in one device call, e.g. with `train.micro_batch=8` and without.

On a CPU (`--device cpu`, the tiny model, float32) it runs as the smoke test of tests/scripts.
"""

from __future__ import annotations

import argparse
import gzip
import random
import shutil
import statistics
import time
from pathlib import Path

# text that is no action: the episode loop counts an invalid move and goes on, as with a random model's replies
NOT_AN_ACTION = "lorem ipsum dolor sit amet " * 8


def runs(cfg, codec, mazes: int, seed: int) -> list:
    """mazes x n runs of the loop's shape, played by a scripted engine that answers with cut text."""
    from app.rollout.engines.base import Sampling
    from app.rollout.engines.scripted import ScriptedEngine
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    n = cfg.rollout.n_samples_per_prompt
    requests = [
        EpisodeRequest(generate_maze(seed * 1000 + g, cfg.maze.size), g, s) for g in range(mazes) for s in range(n)
    ]
    engine = ScriptedEngine(codec, [NOT_AN_ACTION], cut_share=1.0, seed=seed, record=False)
    played = play_episodes(
        engine, codec, requests, EpisodeSettings.from_config(cfg), Sampling(cfg.rollout.max_new_tokens)
    )
    rng = random.Random(seed)
    for t in played:
        t.reward = float(rng.random() < 0.5)
    return played


def phase_shares(profile) -> dict[str, float]:
    """Device time (CPU time on a CPU) under the autograd engine's backward, the optimizer, and the rest."""
    from torch.autograd import DeviceType

    events = profile.key_averages()
    on_device = any(getattr(e, "device_time_total", 0) for e in events)

    def total(e) -> float:
        return e.device_time_total if on_device else e.cpu_time_total

    step = sum(total(e) for e in events if e.key == "train_step") or 1.0
    backward = sum(total(e) for e in events if e.key.startswith("autograd::engine::evaluate_function"))
    optimizer = sum(total(e) for e in events if e.key.startswith("Optimizer.step"))
    # the kernels' own rows, in microseconds, as torch's table totals them
    kernels = sum(
        e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )  # a record_function's row on the device spans its kernels: not counted again
    return {"backward": backward / step, "optimizer": optimizer / step, "kernel_us": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/h200.yaml")
    ap.add_argument("--model", default=None, help="model.path (default: the config's; tiny builds the tiny model)")
    ap.add_argument("--mazes", type=int, default=8)
    ap.add_argument("--timed", type=int, default=2, help="steps timed without the profiler, after one warm-up")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps after the timed ones (0: none)")
    ap.add_argument("--trace", action="store_true", help="write the profiled steps' Chrome trace (large at 8B)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cache", default="/tmp/mazerl-bench-models")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from app.config import load_config
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.observe.efficiency import ModelFlops, peak_tflops, phase_efficiency

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # no engine is built here: the config's engine is checked as hf, so a machine without vLLM profiles the trainer
    overrides = ["rollout.engine=hf", "rollout.engine_process=false", *args.overrides]
    overrides += [f"model.path={args.model}"] if args.model else []
    if args.device == "cpu":
        overrides += ["model.dtype=float32", "rollout.engine=hf", "placement.gpus_per_bundle=0"]
    cfg = load_config(args.config, overrides)
    model_dir = str(ensure_model(cfg.model, args.cache))
    trainer = PolicyTrainer(cfg, model_dir, device=args.device)
    flops = ModelFlops.for_model(model_dir, 1)
    on_gpu = args.device != "cpu"
    peak = peak_tflops(torch.cuda.get_device_name()) if on_gpu else 0.0

    def step(seed: int) -> dict:
        batch = runs(cfg, trainer.codec, args.mazes, seed)
        if on_gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with record_function("train_step"):
            metrics = trainer.train_step(batch)
        if on_gpu:
            torch.cuda.synchronize()
        metrics["wall_s"] = time.perf_counter() - started
        return metrics

    def describe(m: dict) -> str:
        tokens = m["forward_tokens"]
        work = flops.train(tokens, cfg.model.recomputed_share)
        mfu = phase_efficiency("train", work, m["wall_s"], 1, peak).get("train_mfu")
        mfu = f", MFU {mfu:.1%}" if mfu is not None else ""
        memory = f", peak {m.get('peak_memory_gb', 0):.1f} GB" if on_gpu else ""
        return f"{m['wall_s']:.2f} s, {tokens:.0f} forward tokens{mfu}{memory}"

    def say(line: str) -> None:  # printed as it comes: the profiler's summary of an 8B step takes minutes
        lines.append(line)
        print(line, flush=True)

    lines: list[str] = []
    say(f"warm-up step: {describe(step(0))}")
    timed = []
    for i in range(args.timed):
        timed.append(step(100 + i))
        say(f"timed step {i + 1}: {describe(timed[-1])}")
    if timed:
        middle = sorted(timed, key=lambda m: m["wall_s"])[(len(timed) - 1) // 2]
        say(f"the step, without the profiler (median of {len(timed)}): {describe(middle)}")
    table = ""
    if args.steps > 0:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities, record_shapes=False) as prof:
            profiled = [step(1 + i) for i in range(args.steps)]
        for i, m in enumerate(profiled, start=1):
            say(f"profiled step {i}: {describe(m)}")
        shares = phase_shares(prof)
        median = statistics.median(m["wall_s"] for m in profiled)
        if on_gpu:  # the share of the steps' wall time the GPU ran kernels: the rest it waited on the host
            busy = shares["kernel_us"] / 1e6 / sum(m["wall_s"] for m in profiled)
            say(f"GPU busy (kernel time over wall time): {busy:.0%}")
        say(
            f"median {median:.2f} s; of the profiled steps' {'device' if on_gpu else 'CPU'} time: backward "
            f"{shares['backward']:.0%}, optimizer {shares['optimizer']:.0%}, the rest (forwards, loss) "
            f"{1 - shares['backward'] - shares['optimizer']:.0%}"
        )
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        print(table, flush=True)
        if args.trace:
            trace = out / "train_trace.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
    (out / "train_profile.txt").write_text(table + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
