"""The supervised warm start on its own: BFS-solver demonstrations → a PEFT adapter for `model.adapter_init`.

    python scripts/sft.py CONFIG OUT_DIR [key=value ...] [--eval-every K] [--device cpu|cuda]

Uses the config's sft.* knobs (steps, lr, mazes_per_step), model, LoRA, maze and rollout settings, and the
same training-maze stream as the GRPO job (never an eval maze). Writes OUT_DIR/step_K/ every --save-every
steps and OUT_DIR/final/, each a PEFT folder (adapter_model.safetensors + adapter_config.json). With
--eval-every, the held-out greedy true solve rate is measured with the transformers engine, so a warm start
can be stopped at the solve rate wanted (the learning run stops at <= 50%). One process, no Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.adapters import write_peft_folder  # noqa: E402
from app.config import ConfigError, load_config  # noqa: E402


def held_out_solve_rate(cfg, engine, trainer, settings) -> dict:
    from app.engines.base import Sampling
    from app.episodes import EpisodeRequest, play_episodes
    from app.evaluation import eval_report
    from app.sampler import eval_mazes

    engine.load_lora(trainer.lora_tensors(), engine.lora_version + 1)
    mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    played = play_episodes(engine, engine.codec, [EpisodeRequest(m, i) for i, m in enumerate(mazes)], settings,
                           Sampling(cfg.rollout.max_new_tokens, 0.0))
    return {k: v for k, v in eval_report(played, cfg.rollout.max_turns).items() if k != "mazes"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for app.main")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out greedy solve rate every K steps (0: at the end only)")
    ap.add_argument("--save-every", type=int, default=0, help="also write OUT/step_K every K steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.sft.steps < 1:
            raise ConfigError("sft.steps", "is 0, so there is nothing to train", "pass sft.steps=N (N >= 1)")
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from actors.rollout import episode_settings
    from app.driver import model_cache
    from app.engines.hf import HFEngine
    from app.model import ensure_model
    from app.sampler import MazeSampler, eval_mazes
    from app.sft import demonstrations
    from app.training import PolicyTrainer

    torch.manual_seed(cfg.train.seed)
    model_dir = str(ensure_model(cfg.model, model_cache(cfg)))
    trainer = PolicyTrainer(cfg, model_dir, device=args.device)
    settings = episode_settings(cfg)
    eval_ids = {m.identity for m in eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)}
    sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, eval_ids)
    engine = HFEngine(model_dir, cfg.lora, dtype=cfg.model.dtype, device=args.device)
    out, log = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for step in range(1, cfg.sft.steps + 1):
        metrics = trainer.sft_step(demonstrations(sampler.next(cfg.sft.mazes_per_step), trainer.codec, settings), cfg.sft.lr)
        entry = {"sft_step": step, "elapsed_s": round(time.perf_counter() - start, 1), **metrics}
        if (args.eval_every and step % args.eval_every == 0) or step == cfg.sft.steps:
            entry.update({f"eval_{k}": v for k, v in held_out_solve_rate(cfg, engine, trainer, settings).items()})
        if args.save_every and step % args.save_every == 0:
            write_peft_folder(trainer.lora_tensors(), trainer.spec, out / f"step_{step}")
        log.append(entry)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items()}), flush=True)
    write_peft_folder(trainer.lora_tensors(), trainer.spec, out / "final")
    (out / "sft_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    print(f"adapter: {out / 'final'}  (start GRPO from it with model.adapter_init={out / 'final'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
