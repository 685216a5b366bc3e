"""How episodes are played: the rollout engine, its sampling, its memory between phases, its schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.config.knobs import knob


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = knob("hf", "generation engine: vllm, or hf (transformers generate)")
    n_samples_per_prompt: int = knob(8, "episodes per maze in a GRPO group", ge=1)
    max_turns: int = knob(15, "actions per episode, the final stop included", ge=1)
    temperature: float = knob(1.0, "sampling temperature of training rollouts", gt=0.0, le=4.0)
    top_p: float = knob(
        1.0,
        "nucleus sampling mass; must be 1 for training rollouts (the trainer scores the whole distribution)",
        gt=0.0,
        le=1.0,
    )
    max_new_tokens: int = knob(32, "token budget of one reply", ge=1, le=4096)
    gpu_memory_utilization: float = knob(0.45, "share of a GPU's memory a vLLM engine may take", gt=0.0, le=0.95)
    sleep_level: Literal[0, 1] = knob(
        1, "vLLM sleep between phases: 0 never, 1 weights to host memory (2 would wipe the LoRA slots)"
    )
    keep_weights: bool = knob(
        False,
        "with sleep_level 1, free only the KV cache between phases: the weights stay on the GPU, so waking "
        "and the adapter sync copy nothing back (training has the weights' memory less)",
    )
    image_history: int = knob(0, "keep only the last K maze images in the context; 0 keeps all", ge=0)
    turn_history: int = knob(
        0,
        "keep only the last K turns (reply + observation) after the task statement; "
        "0 keeps all (1: the context is the task, the last action and the current picture)",
        ge=0,
    )
    max_model_len: int = knob(4096, "longest context (prompt + replies) an engine accepts", ge=256)
    enforce_eager: bool = knob(True, "vLLM without CUDA graphs: fast start, slower decode")
    kv_cache_gb: float = knob(
        0.0,
        "a vLLM engine's KV cache in GiB on a GPU, set instead of measured: engines that start "
        "together on one GPU mis-measure each other (placement.rollouts_per_bundle > 1); "
        "0 sizes it from gpu_memory_utilization",
        ge=0.0,
    )
    schedule: Literal["lockstep", "continuous"] = knob(
        "lockstep",
        "lockstep: each turn of every open episode is one engine batch (batches reproducible); continuous "
        "(vLLM): an episode's next turn enters the engine as soon as its reply is out",
    )
    engine_process: bool = knob(
        False, "vLLM's engine core in its own process, so the episode loop's host work overlaps the GPU's"
    )
    dense_lora: bool = knob(
        False,
        "vLLM: the adapter as two cuBLAS matrix products a projection group instead of vLLM's LoRA kernels (the "
        "engine holds one adapter; its tokens get the same sums)",
    )
    play_ahead: bool = knob(
        False,
        "play step k+1's episodes while step k trains (needs sleep_level 0, train.rollout_ratio_cap): each batch "
        "from the second step on was played by the adapter one version older than the one it trains, and a step "
        "takes about its longer phase",
    )
