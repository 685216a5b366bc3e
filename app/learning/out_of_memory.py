"""A train step that runs out of GPU memory, told as the config error it is.

How much a trainer rank needs depends on knobs together (the model, the micro-batch, the share of decoder layers
checkpointed, the episodes' length) and on what the colocated engine keeps on the GPU while it sleeps; it shows
only in the first train step, after the engines have started and played. torch's error there names allocator
sizes; this names the knob to change first, the others that also free memory, and what the GPU held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from app.config import Config, ConfigError

GIB = 1024**3  # as torch and nvidia-smi count GPU memory


def first_knob(cfg: Config) -> str:
    """The knob that frees the most memory for the least time: checkpointing first, then the micro-batch."""
    if not cfg.model.gradient_checkpointing:
        return "model.gradient_checkpointing"
    if cfg.model.checkpointed_layers < 1.0:
        return "model.checkpointed_layers"
    return "train.micro_batch"


def out_of_memory_error(cfg: Config, phase: str, memory: dict[str, int]) -> ConfigError:
    """The ConfigError for a `phase` ("train step", "warm-start step") that ran out of GPU memory; `memory` is
    `gpu_memory`'s account of the GPU when it did."""
    m, r = cfg.model, cfg.rollout
    problem = (
        f"the trainer ran out of GPU memory in a {phase}: its tensors reached {memory['peak'] / GIB:.1f} GiB of the "
        f"GPU's {memory['total'] / GIB:.1f} GiB while other processes (the colocated rollout engine) held "
        f"{memory['others'] / GIB:.1f} GiB"
    )
    fixes = []
    if not m.gradient_checkpointing:
        fixes.append("set model.gradient_checkpointing=true (activations recomputed in the backward pass)")
    elif m.checkpointed_layers < 1.0:
        fixes.append(
            f"raise model.checkpointed_layers (now {m.checkpointed_layers}; 1.0 recomputes every decoder layer and "
            "keeps the least)"
        )
    if cfg.train.micro_batch > 1:
        fixes.append(f"lower train.micro_batch (now {cfg.train.micro_batch})")
    if r.engine == "vllm" and r.sleep_level == 1 and r.keep_weights:
        fixes.append("set rollout.keep_weights=false (the engine's weights leave the GPU while it trains)")
    fixes.append("or run on GPUs with more memory")
    return ConfigError(first_knob(cfg), problem, "; ".join(fixes))


def gpu_memory(device: torch.device | str) -> dict[str, int]:
    """Bytes: the GPU's total, this process's peak of allocated tensors, and what every other process holds."""
    free, total = torch.cuda.mem_get_info(device)
    others = max(0, total - free - torch.cuda.memory_reserved(device))
    return {"total": total, "peak": torch.cuda.max_memory_allocated(device), "others": others}


@contextlib.contextmanager
def explained_out_of_memory(cfg: Config, device: torch.device | str, phase: str) -> Iterator[None]:
    """Runs the block; torch's out-of-memory error leaves it as `out_of_memory_error`'s ConfigError."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if not str(device).startswith("cuda"):
            raise
        raise out_of_memory_error(cfg, phase, gpu_memory(device)) from e
