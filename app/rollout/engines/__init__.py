"""Generation engines behind one interface (`base.Engine`): vLLM, and transformers.

Each engine's module is imported when one is made: the transformers engine's brings PEFT, so a process that only
names `Sampling` (the evaluator) or makes a vLLM engine starts without it (~0.5-1 s less CPU at
each actor start on a 2-core machine), and vLLM itself is imported only by the vLLM engine."""

from __future__ import annotations

from app.config import Config
from app.rollout.engines.base import Engine, Generation, Prompt, Sampling

__all__ = ["Engine", "Generation", "Prompt", "Sampling", "make_engine", "max_images_per_prompt"]


def max_images_per_prompt(cfg: Config) -> int:
    # the opening's picture plus one per observation in the turn window, at most one per turn
    turns, window = cfg.rollout.max_turns, cfg.rollout.turn_history
    in_view = min(window + 1, turns) if window else turns
    return min(cfg.rollout.image_history or in_view, in_view)


def make_engine(cfg: Config, model_dir: str, device: str = "cpu", index: int = 0) -> Engine:
    """The engine the config asks for, on this process's device; index: the rollout actor's, which offsets the
    engine's own seed (the one a CPU engine samples with), so that actors do not draw the same random numbers."""
    if cfg.rollout.engine == "vllm":
        from app.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(
            model_dir,
            cfg.lora,
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len,
            max_images=max_images_per_prompt(cfg),
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            sleep_level=cfg.rollout.sleep_level,
            keep_weights=cfg.rollout.keep_weights,
            enforce_eager=cfg.rollout.enforce_eager,
            seed=cfg.train.seed + index,
            kv_cache_gb=cfg.rollout.kv_cache_gb,
            schedule=cfg.rollout.schedule,
            engine_process=cfg.rollout.engine_process,
            dense_lora=cfg.rollout.dense_lora,
        )
    from app.rollout.engines.hf import HFEngine

    return HFEngine(model_dir, cfg.lora, dtype=cfg.model.dtype, device=device)
