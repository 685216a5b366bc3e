"""Can the model learn to see walls? Full-model SFT on open-move questions alone, from the config's model.

    python scripts/perception_probe.py CONFIG OUT.jsonl [key=value ...] [--steps N] [--lr LR] [--batch B]
                                       [--eval-every K] [--device cpu|cuda]

The learning run's warm start plateaus with about one decision in two right (docs/RESULTS.md). A move needs
two things: seeing which neighbours of the agent are open, and knowing which of them leads to the goal. This
isolates the first: each example is one `app.sft.perception_example` (a training maze, the agent on a random
open cell, "which moves are open?"), and the score is the teacher-forced probability of the exact answer on
64 held-out mazes' questions (a model that sees answers with probability near 1; one that guesses scores the
prior of the answer sets). Minutes on a GPU, so architecture and learning-rate variants can be compared before
a learning run spends its device time. One line per evaluation in OUT.jsonl.
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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, ["rollout.engine=hf", *args.overrides])
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from app import grpo
    from app.driver import model_cache
    from app.model import ensure_model
    from app.sampler import MazeSampler, eval_mazes
    from app.sft import perception_example
    from app.training import PolicyTrainer, build_items

    torch.manual_seed(cfg.train.seed)
    torch.set_float32_matmul_precision("high")
    trainer = PolicyTrainer(cfg, str(ensure_model(cfg.model, model_cache(cfg))), device=args.device, train_base=True)
    held_out = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, {m.identity for m in held_out})
    rng = np.random.default_rng(cfg.train.seed)

    def question(maze):
        cells = maze.open_cells()
        return perception_example(maze, cells[rng.integers(len(cells))], trainer.codec, cfg.maze.cell_px)

    tests = build_items([question(m) for m in held_out], grpo.AdvantageResult([0.0] * len(held_out),
                                                                               [True] * len(held_out), len(held_out), 0))

    def score() -> dict:
        exact, nll, tokens = [], 0.0, 0.0
        for i in range(0, len(tests), cfg.train.micro_batch):
            logp, _, mask, _ = trainer.token_logprobs(tests[i:i + cfg.train.micro_batch], with_grad=False, temperature=1.0)
            exact += torch.exp((logp * mask).sum(1)).tolist()
            nll, tokens = nll - (logp * mask).sum().item(), tokens + mask.sum().item()
        return {"p_exact": float(np.mean(exact)), "answered": float(np.mean([p > 0.5 for p in exact])),
                "heldout_nll": nll / max(tokens, 1.0)}

    start = time.perf_counter()
    with Path(args.out).open("a") as log:
        for step in range(1, args.steps + 1):
            lr = args.lr * min(1.0, step / args.warmup) if args.warmup else args.lr
            metrics = trainer.sft_step([question(m) for m in sampler.next(args.batch)], lr)
            if step % args.eval_every == 0 or step == args.steps:
                entry = {"step": step, "elapsed_s": round(time.perf_counter() - start, 1), "lr": lr,
                         "train_nll": metrics["sft_nll"], **score()}
                log.write(json.dumps(entry) + "\n")
                log.flush()
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
