"""Where a full-model SFT step of the learning run's small model spends its time, on the GPU.

    python scripts/lab/profile_sft.py OUT [key=value ...]
        (scripts/lab/configs/learn_h200.yaml, the SFT stage's settings)

The learning run's SFT steps took ~1.15 s for ~70k tokens of a 10 M-parameter model (docs/journal/): far from what
the GPU can do, so the step is bound by something else. This times the parts of a step with the device synchronised
(making demonstrations, building inputs, the vision tower, forward, backward, optimizer), and a see-stage step
(SEE_QUESTIONS open-move questions, scripts/lab/perception_probe.py), in three variants side by side on the same
data: as the trainer runs now (rotary positions made on the host, app.learning.speedups.rope_positions, and the
vision tower's attention batched, app.model.vision_attention), with the positions left to the model's own
per-sequence loop, and with the vision attention per picture too (transformers' loops). Writes torch.profiler's top
operators (current variant) to OUT/profile_sft.txt. Needs only torch/transformers/peft (no vLLM, no Ray)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.config import load_config  # noqa: E402
from app.learning import grpo  # noqa: E402
from app.learning.batch import build_items, micro_batches  # noqa: E402
from app.learning.sft import demonstration, perception_example  # noqa: E402
from app.learning.training import PolicyTrainer  # noqa: E402
from app.model.build import ensure_model  # noqa: E402
from app.model.load import load_processor  # noqa: E402
from app.rollout.encoding import ChatCodec  # noqa: E402
from app.world.rules import EpisodeSettings  # noqa: E402
from app.world.sampler import MazeSampler  # noqa: E402

# now: host-made rotary positions + batched vision attention; model_pos: the model's own positions (before
# 2026-12-02, session 11); loops: the model's positions and per-picture vision attention (before 2026-12-01)
VARIANTS = ("now", "model_pos", "loops")
SEE_QUESTIONS = int(os.environ.get("SEE_QUESTIONS", "256"))  # fewer for a CPU smoke test


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        "scripts/lab/configs/learn_h200.yaml",
        ["model.dtype=float32", "rollout.engine=hf", "output_dir=/tmp/mazerl-prof", *sys.argv[2:]],
    )
    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke test
    model_dir = str(ensure_model(cfg.model, "/tmp/mazerl-prof/models"))
    settings = EpisodeSettings.from_config(cfg)
    sampler = MazeSampler(cfg.train.seed, cfg.train.dataset_size, cfg.maze.size, set())
    rows = []
    micro = cfg.train.micro_batch
    codec = ChatCodec(load_processor(model_dir))
    batches = [sampler.next(cfg.sft.mazes_per_step) for _ in range(6)]
    made = [
        timed(lambda b=b: [demonstration(m, codec, settings, noise=cfg.sft.noise, seed=1) for m in b], device)
        for b in batches
    ]
    demos = [d for d, _ in made]  # the same steps for every variant
    questions = [
        [
            perception_example(m, m.open_cells()[k % len(m.open_cells())], codec, cfg.maze.cell_px)
            for k, m in enumerate(sampler.next(SEE_QUESTIONS))
        ]
        for _ in range(4)
    ]
    for label in VARIANTS:
        trainer = PolicyTrainer(cfg, model_dir, device=device.type, train_base=True)
        trainer.forward.host_positions = label == "now"
        if label == "loops":
            for module in trainer.model.modules():
                module.__dict__.pop("forward", None)
        steps = [timed(lambda d=d: trainer.sft_step(d, 2e-4), device)[1] for d in demos]  # first: picture cache misses
        see = [timed(lambda q=q: trainer.sft_step(q, 2e-4), device)[1] for q in questions]
        items = build_items(
            demos[-1], grpo.AdvantageResult([0.0] * len(demos[-1]), [True] * len(demos[-1]), len(demos[-1]), 0)
        )
        batch = micro_batches(items, items, micro).get(0)[0]
        (inputs, _, _), t_inputs = timed(lambda: trainer.forward.inputs(batch), device)
        visual = trainer.model.base_model.model.model.visual
        _, t_vision = timed(lambda: visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]), device)
        (logp, _, mask, _), t_fwd = timed(
            lambda: trainer.token_logprobs(batch, with_grad=True, temperature=1.0), device
        )
        _, t_bwd = timed(lambda: (-(logp * mask).sum()).backward(), device)
        tokens = sum(len(it.token_ids) for it in items)
        rows.append(
            (
                label,
                micro,
                len(items),
                tokens,
                median(t for _, t in made),
                steps[0],
                median(steps[1:]),
                len(batch),
                t_inputs,
                t_vision,
                t_fwd,
                t_bwd,
                median(see[1:]),
            )
        )
        if label == "now":
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                trainer.sft_step(demos[-1], 2e-4)
                sync(device)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            if device.type == "cuda":
                table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
            (out / "profile_sft.txt").write_text(table)
        trainer = None  # the next variant's model takes its memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    head = (
        "variant",
        "micro",
        "seqs",
        "tokens",
        "demos_s",
        "step1_s",
        "step_s",
        "pass_seqs",
        "inputs_s",
        "vision_s",
        "fwd_s",
        "bwd_s",
        "see_s",
    )
    lines = [" ".join(f"{h:>9}" for h in head)]
    lines += [" ".join(f"{v:>9.3f}" if isinstance(v, float) else f"{v:>9}" for v in r) for r in rows]
    for other in rows[1:]:
        lines.append(
            f"{other[0]} / now: SFT step {other[6] / rows[0][6]:.2f}, see step ({SEE_QUESTIONS} questions) "
            f"{other[12] / rows[0][12]:.2f}"
        )
    (out / "profile_sft_table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
