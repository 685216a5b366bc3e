"""Can the model learn to see walls? Full-model SFT on open-move questions alone, from the config's model.

    python scripts/lab/perception_probe.py CONFIG OUT.jsonl [key=value ...] [--steps N] [--lr LR] [--batch B]
                                       [--eval-every K] [--max-minutes M] [--stop-above P] [--save DIR]
                                       [--device cpu|cuda]

The learning run's warm start plateaus with about one decision in two right (docs/journal/). A move needs
two things: seeing which neighbours of the agent are open, and knowing which of them leads to the goal. This
isolates the first: each example is one `app.learning.sft.perception_example` (a training maze, the agent on a random
open cell, "which moves are open?"), and the score is the teacher-forced probability of the exact answer on
64 held-out mazes' questions (a model that sees answers with probability near 1; one that guesses scores the
prior of the answer sets). Minutes on a GPU, so architecture and learning-rate variants can be compared before
a learning run spends its device time. One line per evaluation in OUT.jsonl. With --save, the trained model
is written as a model folder: a warm start that already sees the walls, for scripts/sft.py (`model.path=DIR`).

The score is also split by where the agent stands (p_exact_room, p_exact_passage). In a passage between two rooms the
answer follows from the position alone (the two rooms either side are open, the pillars beside it are walls); in a
room it takes seeing which of its up to four passages are carved. A model that has learned positions but not walls
scores ~1 on passages and the prior on rooms: the fifth H200 attempt's plateau at p_exact 0.63 (docs/journal/).
--rooms P asks that share of the training questions in rooms (default: every open cell alike, ~53% rooms at 7x7).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import ConfigError, load_config  # noqa: E402
from app.world.maze import is_room  # noqa: E402


def cell_to_ask(maze, rng: np.random.Generator, rooms: float | None = None) -> tuple[int, int]:
    """A random open cell of `maze`; with `rooms`, a room with that probability and a passage otherwise."""
    cells = maze.open_cells()
    if rooms is not None:
        in_room = rng.random() < rooms
        cells = [c for c in cells if is_room(c) == in_room] or cells
    return tuple(cells[rng.integers(len(cells))])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for app.main")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch", type=int, default=32, help="questions per step")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop (after one last evaluation) past this time")
    ap.add_argument("--stop-above", type=float, default=0.0, help="stop once the held-out p_exact exceeds this")
    ap.add_argument("--save", help="write the trained model here at the end (a model folder for model.path)")
    ap.add_argument("--rooms", type=float, default=None, help="share of training questions asked in rooms (0..1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_intermixed_args(argv)  # flags may sit between the overrides (the sweep script mixes them)
    if args.rooms is not None and not 0.0 <= args.rooms <= 1.0:
        print(f"--rooms must be a share between 0 and 1, got {args.rooms}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, ["rollout.engine=hf", *args.overrides])
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from app.driver.preflight import model_cache
    from app.learning import grpo
    from app.learning.batch import build_items
    from app.learning.sft import perception_example
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.model.merge import export_full_model
    from app.world.sampler import MazeSampler, eval_mazes

    torch.manual_seed(cfg.train.seed)
    torch.set_float32_matmul_precision("high")
    model_dir = str(ensure_model(cfg.model, model_cache(cfg)))
    trainer = PolicyTrainer(cfg, model_dir, device=args.device, train_base=True)
    held_out = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, {m.identity for m in held_out})
    rng = np.random.default_rng(cfg.train.seed)

    asked: dict[tuple[str, tuple[int, int]], object] = {}

    def question(maze, cell):
        # The 704 training 7x7 mazes have ~12k (maze, cell) pairs, and a see stage draws several times that:
        # making a question (render, PNG, tokenise) is host work the GPU step waits for, so each is made once.
        key = (maze.identity, cell)
        if key not in asked:
            asked[key] = perception_example(maze, cell, trainer.codec, cfg.maze.cell_px)
        return asked[key]

    test_cells = [cell_to_ask(m, rng) for m in held_out]
    test_in_room = [is_room(cell) for cell in test_cells]
    tests = build_items(
        [question(m, c) for m, c in zip(held_out, test_cells)],
        grpo.AdvantageResult([0.0] * len(held_out), [True] * len(held_out), len(held_out), 0),
    )

    def score() -> dict:
        exact, nll, tokens = [], 0.0, 0.0
        for i in range(0, len(tests), cfg.train.micro_batch):
            logp, _, mask, _ = trainer.token_logprobs(
                tests[i : i + cfg.train.micro_batch], with_grad=False, temperature=1.0
            )
            exact += torch.exp((logp * mask).sum(1)).tolist()
            nll, tokens = nll - (logp * mask).sum().item(), tokens + mask.sum().item()

        def mean_where(room: bool) -> float | None:
            chosen = [p for p, r in zip(exact, test_in_room) if r == room]
            return float(np.mean(chosen)) if chosen else None

        return {
            "p_exact": float(np.mean(exact)),
            "answered": float(np.mean([p > 0.5 for p in exact])),
            "heldout_nll": nll / max(tokens, 1.0),
            "p_exact_room": mean_where(True),
            "p_exact_passage": mean_where(False),
        }

    start = time.perf_counter()
    with Path(args.out).open("a") as log:
        for step in range(1, args.steps + 1):
            lr = args.lr * min(1.0, step / args.warmup) if args.warmup else args.lr
            mazes = sampler.next(args.batch)
            metrics = trainer.sft_step([question(m, cell_to_ask(m, rng, args.rooms)) for m in mazes], lr)
            out_of_time = args.max_minutes > 0 and time.perf_counter() - start > 60 * args.max_minutes
            if step % args.eval_every == 0 or step == args.steps or out_of_time:
                entry = {
                    "step": step,
                    "elapsed_s": round(time.perf_counter() - start, 1),
                    "lr": lr,
                    "train_nll": metrics["sft_nll"],
                    **score(),
                }
                log.write(json.dumps(entry) + "\n")
                log.flush()
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
                if args.stop_above and entry["p_exact"] > args.stop_above:
                    break
            if out_of_time:
                break
    if args.save:
        # float32: the folder is a starting point for more training, not for serving
        print(f"model: {export_full_model(trainer.model, model_dir, args.save, 'float32')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
