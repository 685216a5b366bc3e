"""The supervised warm start on its own: BFS-solver demonstrations → a PEFT adapter for `model.adapter_init`.

    python scripts/sft.py CONFIG OUT_DIR [key=value ...] [--eval-every K] [--device cpu|cuda]
    python scripts/sft.py CONFIG OUT_DIR --full [--max-minutes M] [--stop-above RATE] ...   # every weight trains
    python scripts/sft.py CONFIG OUT_DIR --full --eval-every 10 --fine-eval 0.25 2 --stop-above 0.5   # dense near 50%

Uses the config's sft.* knobs (steps, lr, mazes_per_step), model, LoRA, maze and rollout settings, and the
same training-maze stream as the GRPO job (never an eval maze). Writes OUT_DIR/step_K/ every --save-every
steps and OUT_DIR/final/, each a PEFT folder (adapter_model.safetensors + adapter_config.json). With
--eval-every, the held-out greedy true solve rate is measured with the transformers engine, so a warm start
can be stopped at the solve rate wanted (the learning run stops at <= 50%). One process, no Ray.

With --full every weight trains (vision tower included: a model built here from random weights has to learn
to see), and each save is a model folder with the LoRA merged in, for `model.path` (app.model.merge.export_full_model);
its held-out solve rate is measured on that folder as written. OUT/sft_log.jsonl has one line per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import ConfigError, load_config  # noqa: E402
from app.model.adapters import write_peft_folder  # noqa: E402


def summary(report: dict) -> dict:
    """An eval report without its per-maze records: one log line."""
    return {k: v for k, v in report.items() if k != "mazes"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for app.main")
    ap.add_argument(
        "--eval-every", type=int, default=0, help="held-out greedy solve rate every K steps (0: at the end only)"
    )
    ap.add_argument("--save-every", type=int, default=0, help="also write OUT/step_K every K steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action="store_true", help="train every weight; save model folders, not adapters")
    ap.add_argument("--warmup", type=int, default=0, help="linear learning-rate warmup over this many steps")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (after a final eval and save) past this time")
    ap.add_argument("--stop-above", type=float, default=0, help="stop once the held-out solve rate exceeds this")
    ap.add_argument(
        "--fine-eval",
        nargs=2,
        type=float,
        metavar=("RATE", "K"),
        default=None,
        help="once an evaluation reads at least RATE, evaluate every K steps instead of --eval-every: "
        "SFT can cross 35%% -> 77%% in 10 steps (docs/RESULTS.md), so a start just under a bound "
        "needs dense readings near it and none before",
    )
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--full: saved weights")
    ap.add_argument(
        "--gpu-share",
        type=float,
        default=0.0,
        help="at most this share of the GPU's memory (torch.cuda.set_per_process_memory_fraction): PyTorch's cache "
        "returns blocks before it grows past it, so runs that share a GPU keep to their part (0: no bound)",
    )
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.sft.steps < 1:
            raise ConfigError("sft.steps", "is 0, so there is nothing to train", "pass sft.steps=N (N >= 1)")
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from app.driver.preflight import model_cache
    from app.learning.sft import WarmStartData
    from app.learning.training import PolicyTrainer
    from app.model.build import ensure_model
    from app.model.merge import export_full_model
    from app.observe.evaluation import play_held_out
    from app.rollout.engines.hf import HFEngine
    from app.world.rules import EpisodeSettings
    from app.world.sampler import MazeSampler, eval_mazes

    eval_ids = {m.identity for m in eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)}
    try:
        sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, eval_ids)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    torch.manual_seed(cfg.train.seed)
    on_gpu = args.device.startswith("cuda")
    if args.gpu_share and on_gpu:
        torch.cuda.set_per_process_memory_fraction(args.gpu_share)
    torch.set_float32_matmul_precision("high")  # TF32 on a GPU: float32 weights, tensor-core matmuls
    model_dir = str(ensure_model(cfg.model, model_cache(cfg)))
    trainer = PolicyTrainer(cfg, model_dir, device=args.device, train_base=args.full)
    settings = EpisodeSettings.from_config(cfg)
    engine = None if args.full else HFEngine(model_dir, cfg.lora, dtype=cfg.model.dtype, device=args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(name: str) -> Path:
        if args.full:
            return export_full_model(trainer.model, model_dir, out / name, args.save_dtype)
        return write_peft_folder(trainer.trained_tensors(), trainer.spec, out / name)

    def evaluate(folder: Path | None) -> dict:
        if args.full:  # the folder as written is what a GRPO run would start from
            return summary(
                play_held_out(cfg, HFEngine(str(folder), cfg.lora, dtype=cfg.model.dtype, device=args.device))
            )
        engine.load_lora(trainer.trained_tensors(), engine.lora_version + 1)
        return summary(play_held_out(cfg, engine))

    data = WarmStartData(trainer.codec, settings, cfg.sft, seed=cfg.train.seed)

    every = args.eval_every
    if args.fine_eval and (args.fine_eval[1] < 1 or not float(args.fine_eval[1]).is_integer() or not every):
        print("--fine-eval RATE K needs a whole K >= 1 and --eval-every", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with (out / "sft_log.jsonl").open("a") as log:
        for step in range(1, cfg.sft.steps + 1):
            lr = cfg.sft.lr * min(1.0, step / args.warmup) if args.warmup else cfg.sft.lr
            metrics = trainer.sft_step(data.batch(sampler.next(cfg.sft.mazes_per_step)), lr)
            elapsed = time.perf_counter() - start
            last = step == cfg.sft.steps or bool(args.max_minutes and elapsed > args.max_minutes * 60)
            evaluating = bool(every and step % every == 0) or last
            folder = None
            if (args.save_every and step % args.save_every == 0) or (args.full and evaluating):
                folder = save(f"step_{step}")
            entry = {"sft_step": step, "elapsed_s": round(elapsed, 1), "lr": lr, **metrics}
            if evaluating:
                entry.update({f"eval_{k}": v for k, v in evaluate(folder).items()})
                if on_gpu:  # what this process holds of the GPU, for runs that share it
                    entry.update(
                        peak_allocated_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                        peak_reserved_gb=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                    )
                if args.fine_eval and entry["eval_solve_rate"] >= args.fine_eval[0]:
                    every = int(args.fine_eval[1])
            log.write(json.dumps(entry) + "\n")
            log.flush()
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items()}), flush=True)
            if last or (args.stop_above and entry.get("eval_solve_rate", 0.0) > args.stop_above):
                break
    final = save("final")
    if args.full:
        print(f"model: {final}  (start GRPO from it with model.path={final})")
    else:
        saved = " lora.modules_to_save=[visual]" if cfg.lora.modules_to_save else ""  # the tower travels with it
        print(f"adapter: {final}  (start GRPO from it with model.adapter_init={final}{saved})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
