"""Play mazes through the serving API (python -m app.serve) with the `openai` client.

    python scripts/play.py --base-url http://127.0.0.1:8000/v1 --model global_step_000020 \\
        [--config runs/tiny/config.yaml] [--set maze.size=7 ...] [--seeds 1000000-1000015] \\
        [--gif replay.gif] [--json results.json] [--api-key-env MAZERL_TOKEN] [--concurrency 4]

Each episode is the one training plays (app.world.dialogue messages, app.world.maze environment, the config's turn
budget, image window and feedback), greedy by default. The default seeds are the evaluator's held-out set
(eval.seed, eval.num_mazes of the config), so the solve rate printed here is comparable with the run's
eval solve rate. The GIF replays one episode (the first solved one, else the first) as app.observe.report draws
the evaluator's replays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from anywhere

from app.serve.client import Reply, play  # noqa: E402
from app.world.rules import EpisodeSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_seeds(text: str) -> list[int]:
    """'3', '0-15' (inclusive) or '1,5,9-12'."""
    seeds: list[int] = []
    for piece in text.split(","):
        first, sep, last = piece.strip().partition("-")
        seeds.extend(range(int(first), int(last) + 1) if sep else [int(first)])
    return seeds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="base", help="'base' or an adapter name from GET /v1/models")
    p.add_argument(
        "--api-key-env", default="MAZERL_TOKEN", help="variable holding the server's bearer token (unset: no token)"
    )
    p.add_argument(
        "--config",
        default=str(ROOT / "configs" / "tiny.yaml"),
        help="the training config (a run's config.yaml): maze size, turns, image window, feedback",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--seeds", help="maze seeds, e.g. 0-15 or 1,5,9 (default: the config's eval set)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, as the evaluator plays")
    p.add_argument("--concurrency", type=int, default=1, help="episodes played at the same time")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--gif", help="write an animated GIF of one episode here")
    p.add_argument("--json", help="write the per-maze results here")
    return p.parse_args(argv)


def server_reply(client, model: str, settings: EpisodeSettings, temperature: float):
    from app.model.load import VISION_TOKENS

    def reply(messages: list[dict]) -> Reply:
        completion = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=temperature,
            max_tokens=settings.max_new_tokens,
            # return_token_ids: the sampled ids, sent back with the reply so nothing is re-tokenized;
            # bad_words: what keeps vLLM's own server (--engine serve-llm) from sampling vision tokens
            extra_body={"return_token_ids": True, "bad_words": list(VISION_TOKENS)},
        )
        choice = completion.choices[0]
        return Reply(choice.message.content or "", getattr(choice, "token_ids", None))

    return reply


def write_gif(summary: dict, settings: EpisodeSettings, out: str) -> Path:
    from app.observe.replay import pick_episode, replay_frames, save_gif

    frames, _ = replay_frames(pick_episode(summary["mazes"]), settings.maze_size, settings.cell_px, settings.max_turns)
    return save_gif(frames, Path(out))


def main(argv: list[str] | None = None) -> int:
    import openai

    from app.config import load_config
    from app.world.maze import generate_maze
    from app.world.sampler import eval_mazes

    args = parse_args(argv)
    cfg = load_config(args.config, args.set, check_paths=False)
    settings = EpisodeSettings.from_config(cfg)
    if args.seeds:
        mazes = [generate_maze(s, settings.maze_size) for s in parse_seeds(args.seeds)]
    else:
        mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, settings.maze_size)
    client = openai.OpenAI(
        base_url=args.base_url, api_key=os.environ.get(args.api_key_env) or "none", timeout=args.timeout, max_retries=0
    )
    try:
        summary = play(mazes, settings, server_reply(client, args.model, settings, args.temperature), args.concurrency)
    except openai.APIStatusError as e:
        print(f"the server answered {e.status_code}: {e.message}", file=sys.stderr)
        return 1
    except openai.APIConnectionError as e:
        print(f"cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    summary["model"] = args.model
    print(
        f"{args.model}: solve rate {summary['solve_rate']:.3f} ({summary['solved']}/{summary['num_mazes']} mazes; "
        f"{summary['solvable']} solvable within {settings.max_turns} turns), mean turns {summary['mean_turns']:.1f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.gif:
        print(f"replay: {write_gif(summary, settings, args.gif)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
