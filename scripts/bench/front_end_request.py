"""What adding one rollout request costs the process that drives a vLLM engine: vLLM's front end renders it
(`LLM._preprocess_cmpl`) and the engine takes it (`LLMEngine.add_request`), as a lockstep turn adds 64 of them.

    python scripts/bench/front_end_request.py [--model DIR] [--episodes 64] [--turns 13] [--repeats 3]

The prompts are a rollout's: `--episodes` runs (8 a maze) of scripted moves, every turn's prompt with the whole
history. Each variant adds every prompt of every turn, then aborts them (nothing is generated), `--repeats` times.
Variants: vLLM's plain sampling parameters (`bad_words` as strings, tokenized again for each request, deep-copied)
with the pictures as PIL images; the engine's own parameters (app/rollout/engines/vllm.py: the vision tokens' ids
tokenized once, no deep copy) with PIL images; and the engine's whole request (its parameters, each picture an
array made once per content id). Printed last: microseconds a request, median of the repeats, and the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.config import LoraSettings, ModelConfig  # noqa: E402
from app.model.load import VISION_TOKENS  # noqa: E402
from app.rollout.engines.base import Sampling  # noqa: E402
from app.rollout.engines.vllm import VLLMEngine  # noqa: E402
from app.rollout.episodes import EpisodeRequest, Pictures, RunningEpisode  # noqa: E402
from app.world import dialogue  # noqa: E402
from app.world.maze import DIRECTION_OFFSETS, Action, generate_maze  # noqa: E402
from app.world.rules import EpisodeSettings  # noqa: E402
from scripts.bench.schedules import ensure_model  # noqa: E402


def rollout_prompts(engine: VLLMEngine, episodes: int, turns: int) -> list:
    """Every prompt of `episodes` scripted runs, turn by turn, each run moving at random (walls included)."""
    settings = EpisodeSettings(turns, 9, 32, 0, 8192)
    pictures, rng = Pictures(settings.cell_px), random.Random(0)
    running = [
        RunningEpisode(EpisodeRequest(generate_maze(100 + i // 8, 9), i // 8, i % 8), engine.codec, settings, pictures)
        for i in range(episodes)
    ]
    prompts = []
    for _ in range(turns):
        open_runs = [r for r in running if not r.env.done]
        prompts.extend(r.prompt() for r in open_runs)
        for r in open_runs:
            reply = engine.codec.reply_segment(dialogue.demo_reply(Action.move(rng.choice(list(DIRECTION_OFFSETS)))))
            r.advance(reply.token_ids, [0.0] * len(reply.token_ids), "stop")
    return prompts


def plain_params(engine: VLLMEngine, sampling: Sampling):
    """The engine's parameters as vLLM's caller writes them: the vision tokens as bad words (tokenized again for each
    request), deep-copied on the way in."""
    params = engine._params(sampling, None)
    params.bad_words, params._bad_words_token_ids, params.skip_clone = list(VISION_TOKENS), None, False
    return params


def pil_request(engine: VLLMEngine, prompt, i: int) -> dict:
    """The request with its pictures as the episode loop holds them (PIL images), named by their content ids."""
    return {
        "prompt_token_ids": engine.codec.collapse_image_pads(prompt.token_ids),
        "multi_modal_data": {"image": list(prompt.images)},
        "multi_modal_uuids": {"image": list(prompt.image_ids)},
    }


def seconds_to_add(engine: VLLMEngine, prompts: list, make_params, make_request) -> float:
    llm, ids = engine.llm, []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rendered = llm._preprocess_cmpl([make_request(engine, prompt, i)])[0]
        ids.append(f"bench-{i}")
        llm.llm_engine.add_request(ids[-1], rendered, make_params(), lora_request=None)
    seconds = time.perf_counter() - start
    llm.llm_engine.abort_request(ids)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen3-VL folder; none: the tiny model")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=13)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    model_dir = args.model or str(ensure_model(ModelConfig(), "/tmp/mazerl-bench-models"))
    lora = LoraSettings(rank=32, alpha=64) if args.model else LoraSettings(rank=8, alpha=16)
    engine = VLLMEngine(model_dir, lora, dtype="bfloat16" if gpu else "float32", max_model_len=8192, max_images=32)
    prompts = rollout_prompts(engine, args.episodes, args.turns)
    sampling = Sampling(16, 1.0)
    own_params = lambda: engine._params(sampling, None)  # noqa: E731
    own_request = type(engine)._request
    variants = {
        "plain parameters, PIL": (lambda: plain_params(engine, sampling), pil_request),
        "engine's parameters, PIL": (own_params, pil_request),
        "the engine's request": (own_params, own_request),
    }
    seconds_to_add(engine, prompts, own_params, own_request)  # the processor cache warm for all
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (params, request) in variants.items():
            times[name].append(seconds_to_add(engine, prompts, params, request) / len(prompts) * 1e6)
    engine.shutdown()
    plain, own = statistics.median(times["plain parameters, PIL"]), statistics.median(times["the engine's request"])
    print(f"{len(prompts)} requests ({args.episodes} runs x {args.turns} turns), {'GPU' if gpu else 'CPU'} machine")
    for name in variants:
        print(f"{name:26} {statistics.median(times[name]):8.1f} us a request  {[round(t) for t in times[name]]}")
    print(f"ratio, plain to the engine's: {plain / own:.2f}")


if __name__ == "__main__":
    main()
