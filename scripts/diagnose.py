"""Why does a policy fail the held-out mazes? Each turn classed as a right move, a wrong opening, a wall, a loop.

    python scripts/diagnose.py CONFIG MODEL_DIR [key=value ...] [--adapter DIR] [--questions] [--device cpu|cuda]
    python scripts/diagnose.py CONFIG --eval-json RUN/eval/eval_step_N.json [key=value ...]

The first form plays the config's held-out mazes greedily with the transformers engine (MODEL_DIR: a full
model folder such as an SFT --full checkpoint; --adapter: a PEFT adapter on it); the second reads the actions
an evaluator already wrote. Both print the classes of `app.world.diagnosis` as one JSON line. --questions also asks
the open-move question (`app.world.dialogue.OPEN_MOVES_QUESTION`) on one random open cell of each held-out maze and
scores the greedy answers: exact, and per neighbour (is each of the four moves said iff it is open?).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import ConfigError, load_config  # noqa: E402


def open_move_answers(engine, codec, mazes, cell_px: int, seed: int) -> dict:
    """Greedy answers to the open-move question, one random open cell per maze, against the truth."""
    from app.rollout.encoding import as_image
    from app.rollout.engines.base import Prompt, Sampling
    from app.world import dialogue
    from app.world.maze import DIRECTION_OFFSETS, Action
    from app.world.render import render

    rng = np.random.default_rng(seed)
    cases = []
    for maze in mazes:
        cells = maze.open_cells()
        cases.append((maze, cells[rng.integers(len(cells))]))
    prompts = []
    for maze, cell in cases:
        segment = codec.question(as_image(render(maze, cell, cell_px)), dialogue.OPEN_MOVES_QUESTION)
        prompts.append(Prompt(segment.token_ids, segment.images))
    replies = [codec.decode(g.token_ids) for g in engine.generate(prompts, Sampling(48, 0.0))]
    moves = [dialogue.format_action(Action.move(d)) for d in DIRECTION_OFFSETS]
    exact, neighbours = 0, 0
    for (maze, cell), reply in zip(cases, replies):
        truth = dialogue.open_moves_reply(maze, cell)
        exact += reply.strip() == truth
        neighbours += sum((move in reply) == (move in truth) for move in moves)
    return {
        "questions": len(cases),
        "open_moves_exact": exact / len(cases),
        "open_moves_per_neighbour": neighbours / (4 * len(cases)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("model_dir", nargs="?", help="a model folder to play (not with --eval-json)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for app.main")
    ap.add_argument("--adapter", help="a PEFT adapter folder to load on the model")
    ap.add_argument("--eval-json", help="an evaluator's eval_step_N.json to diagnose instead of playing")
    ap.add_argument("--questions", action="store_true", help="also score greedy answers to the open-move question")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_intermixed_args(argv)
    if args.eval_json and args.model_dir and "=" in args.model_dir:  # no MODEL_DIR: the slot took an override
        args.overrides.insert(0, args.model_dir)
        args.model_dir = None
    if bool(args.eval_json) == bool(args.model_dir):
        print("give either MODEL_DIR (to play) or --eval-json FILE (to read), not both", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from app.world.diagnosis import diagnose_report

    if args.eval_json:
        try:
            found = diagnose_report(json.loads(Path(args.eval_json).read_text()), cfg.maze.size)
        except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            print(f"cannot diagnose {args.eval_json}: {e!r}", file=sys.stderr)
            return 2
        print(json.dumps({"source": args.eval_json, **found}))
        return 0

    from app.model.adapters import read_peft_folder
    from app.observe.evaluation import play_held_out
    from app.rollout.engines.hf import HFEngine
    from app.world.sampler import eval_mazes

    engine = HFEngine(args.model_dir, cfg.lora, dtype=cfg.model.dtype, device=args.device)
    if args.adapter:
        engine.load_lora(read_peft_folder(args.adapter)[0], 1)
    result = {"model": args.model_dir, **diagnose_report(play_held_out(cfg, engine), cfg.maze.size)}
    if args.questions:
        mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
        result.update(open_move_answers(engine, engine.codec, mazes, cfg.maze.cell_px, cfg.eval.seed))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
