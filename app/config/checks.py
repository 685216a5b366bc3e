"""Checks that involve several fields, the environment, or the file system, run before any actor starts.

A batch that must divide over the trainer ranks, a maze that cannot be solved within the turn budget, paths
that must exist: each failure is one `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path

from app.config.adapter_init import check_adapter_init
from app.config.knobs import ConfigError
from app.config.schema import LANGUAGE_MODEL_PROJECTIONS, Config, LoraSettings


def min_maze_turns(size: int) -> int:
    """Fewest turns any maze of this size needs: the corner-to-corner Manhattan distance plus the stop."""
    return 2 * (size - 3) + 1


def check_sampled_policy_is_trained(cfg: Config) -> None:
    """The policy the engines sample must be the one the trainer trains and scores (DESIGN rule 4)."""
    if cfg.lora.dropout > 0:
        raise ConfigError(
            "lora.dropout",
            f"it is {cfg.lora.dropout}: the trainer would train a policy with dropout while the engines sample "
            "without it (vLLM applies none)",
            "set lora.dropout=0",
        )
    if cfg.rollout.top_p < 1:
        raise ConfigError(
            "rollout.top_p",
            f"it is {cfg.rollout.top_p}: the engine renormalises over the nucleus, while the trainer scores each "
            "sampled token under the whole distribution, so the two log-probabilities would disagree",
            "set rollout.top_p=1 (temperature is the knob for how greedy rollouts are)",
        )
    if cfg.train.kl_coef > 0 and (cfg.model.adapter_init or cfg.sft.steps):
        raise ConfigError(
            "train.kl_coef",
            "the KL reference is the model with the adapter disabled, the base before the warm start, not the "
            "policy the run starts from (model.adapter_init / sft.steps)",
            "set train.kl_coef=0 (train.max_update_kl bounds how far a step moves the policy instead)",
        )
    url = cfg.checkpoint.s3_endpoint_url
    if url and "@" in url.partition("://")[2].split("/")[0]:
        raise ConfigError(
            "checkpoint.s3_endpoint_url",
            "it carries credentials (user:password@host); the config is printed and saved with every checkpoint",
            "give the endpoint as scheme://host:port and the keys through AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or ~/.aws)",
        )


def check_combinations(cfg: Config, check_paths: bool = True) -> None:
    """Checks that involve several fields, the environment, or the file system."""
    m, r, t, p, c = cfg.model, cfg.rollout, cfg.train, cfg.placement, cfg.checkpoint
    if m.checkpointed_layers < 1.0 and not m.gradient_checkpointing:
        raise ConfigError(
            "model.checkpointed_layers",
            f"it is {m.checkpointed_layers:g}, but model.gradient_checkpointing is off (no layer is recomputed)",
            "set model.gradient_checkpointing=true, or leave model.checkpointed_layers out",
        )
    if set(cfg.lora.modules_to_save) - {"visual", "language_model"}:
        raise ConfigError(
            "lora.modules_to_save",
            f"{cfg.lora.modules_to_save} names a module other than the vision tower and the language model",
            "use [] (the LoRA alone), [visual] (the LoRA and the vision tower with its mergers) or "
            "[visual, language_model] (every weight)",
        )
    if cfg.lora.tower_lr_scale != LoraSettings().tower_lr_scale and not cfg.lora.modules_to_save:
        raise ConfigError(
            "lora.tower_lr_scale",
            f"it is {cfg.lora.tower_lr_scale:g}, but only the LoRA trains (lora.modules_to_save is [])",
            "set lora.modules_to_save=[visual] to train the tower, or leave lora.tower_lr_scale out",
        )
    if cfg.train.kl_coef > 0 and "language_model" in cfg.lora.modules_to_save:
        raise ConfigError(
            "train.kl_coef",
            "the KL reference is the model with the adapter disabled, and with lora.modules_to_save "
            "[language_model] the language model under the adapter trains too: the reference would move every step",
            "set train.kl_coef=0 (train.max_update_kl bounds how far a step moves the policy instead)",
        )
    if cfg.maze.size % 2 == 0:
        raise ConfigError("maze.size", f"{cfg.maze.size} is even", "use an odd size such as 7, 9 or 11")
    need = min_maze_turns(cfg.maze.size)
    if r.max_turns < need:
        raise ConfigError(
            "rollout.max_turns",
            f"{r.max_turns} turns cannot solve any {cfg.maze.size}x{cfg.maze.size} maze "
            f"(the shortest possible path plus stop takes {need})",
            f"raise rollout.max_turns to at least {need} or lower maze.size",
        )
    episodes = cfg.episodes_per_step
    if episodes % p.num_bundles:
        raise ConfigError(
            "train.mazes_per_step",
            f"{t.mazes_per_step} mazes x {r.n_samples_per_prompt} samples = "
            f"{episodes} episodes do not divide over {p.num_bundles} trainer ranks",
            f"make mazes_per_step * n_samples_per_prompt a multiple of placement.num_bundles ({p.num_bundles})",
        )
    if t.min_informative_groups and not t.refill_rounds:
        raise ConfigError(
            "train.refill_rounds",
            f"it is 0, so min_informative_groups ({t.min_informative_groups}) "
            "can never send a step back for more mazes",
            "set train.refill_rounds to 1 or more (e.g. 3), or train.min_informative_groups=0",
        )
    if t.min_informative_groups > t.mazes_per_step * (1 + t.refill_rounds):
        raise ConfigError(
            "train.min_informative_groups",
            f"{t.min_informative_groups} groups cannot come from "
            f"{1 + t.refill_rounds} rounds of {t.mazes_per_step} mazes",
            "lower it, or raise train.refill_rounds or train.mazes_per_step",
        )
    if p.rollouts_per_bundle > 1 and r.engine == "vllm" and p.gpus_per_bundle > 0:
        if not r.kv_cache_gb:
            raise ConfigError(
                "rollout.kv_cache_gb",
                f"it is 0 with {p.rollouts_per_bundle} engines a GPU: engines that "
                "start together count each other's memory as their own and size their KV cache wrongly "
                "(or fail)",
                "set rollout.kv_cache_gb, e.g. 2 for a small model",
            )
        share = p.gpus_per_bundle * (0.5 if p.colocate_all else 1.0)
        if p.rollouts_per_bundle * r.gpu_memory_utilization > share + 1e-9:
            raise ConfigError(
                "rollout.gpu_memory_utilization",
                f"{p.rollouts_per_bundle} engines x "
                f"{r.gpu_memory_utilization} of the GPU is more than the {share:g} GPU their bundle gives "
                "them",
                f"lower it to {share / p.rollouts_per_bundle:.3g} or less (it is the memory "
                "an engine needs free at its start; kv_cache_gb is what it takes)",
            )
    check_sampled_policy_is_trained(cfg)
    if t.advantage == "grpo" and r.n_samples_per_prompt < 2:
        raise ConfigError(
            "rollout.n_samples_per_prompt",
            "GRPO needs at least 2 samples per maze to compare",
            "set rollout.n_samples_per_prompt to 2 or more (8 in the reference run)",
        )
    if m.tiny.num_heads % m.tiny.num_kv_heads:
        raise ConfigError(
            "model.tiny.num_kv_heads",
            f"{m.tiny.num_kv_heads} does not divide num_heads {m.tiny.num_heads}",
            "pick a divisor of num_heads",
        )
    if (
        r.engine == "vllm"
        and p.gpus_per_bundle == 0
        and m.tiny.head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
        and m.path == "tiny"
    ):
        raise ConfigError(
            "model.tiny.head_dim",
            f"vLLM's CPU attention has no kernel for head_dim {m.tiny.head_dim}",
            "use 32, 64, 80, 96, 112 or 128",
        )
    if r.engine == "vllm" and p.gpus_per_bundle > 0 and m.dtype == "float32":
        raise ConfigError(
            "model.dtype",
            "vLLM's LoRA kernels on GPU take only bfloat16 or float16 activations (float32 fails at engine start)",
            "set model.dtype=bfloat16, or rollout.engine=hf",
        )
    folder = ("model.path", m.path) if m.path != "tiny" else ("output_dir", cfg.output_dir)  # tiny: output_dir/.models
    if r.engine == "vllm" and glob.escape(folder[1]) != folder[1]:
        raise ConfigError(
            folder[0],
            f"{folder[1]!r} holds a glob character (* ? [), and vLLM finds the model's weight files by glob",
            "use a folder whose path has none of * ? [ ]",
        )
    if r.play_ahead and (r.sleep_level != 0 or r.keep_weights):
        raise ConfigError(
            "rollout.play_ahead",
            "the engines play the next step's episodes while the trainers train, so they never sleep",
            "set rollout.sleep_level=0 rollout.keep_weights=false, or rollout.play_ahead=false",
        )
    if r.play_ahead and t.rollout_ratio_cap <= 0:
        raise ConfigError(
            "rollout.play_ahead",
            "each batch it trains was played by the adapter one version older, and without the correction for that "
            "the policy can collapse (the default job's fell from 64% to 0% held-out)",
            "set train.rollout_ratio_cap=2, or rollout.play_ahead=false",
        )
    if r.keep_weights and r.sleep_level == 0:
        raise ConfigError(
            "rollout.keep_weights", "it chooses what sleep frees, and sleep_level 0 never sleeps", "set sleep_level=1"
        )
    vllm_only = (("schedule", r.schedule == "continuous"), ("engine_process", r.engine_process))
    for field, on in vllm_only + (("dense_lora", r.dense_lora),):
        if on and r.engine != "vllm":
            raise ConfigError(
                f"rollout.{field}",
                f"it is {getattr(r, field)}, which only the vLLM engine offers",
                f"set rollout.engine=vllm, or rollout.{field}={'lockstep' if field == 'schedule' else 'false'}",
            )
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine",
            "vllm is not installed in this Python",
            "run scripts/setup.sh, or set rollout.engine=hf"
            + (" rollout.engine_process=false" if r.engine_process else "")
            + (" rollout.dense_lora=false" if r.dense_lora else "")
            + (" rollout.schedule=lockstep" if r.schedule == "continuous" else ""),
        )
    if set(cfg.lora.target_modules) & {"qkv", "proj", "linear_fc1", "linear_fc2", "attn.qkv", "attn.proj"}:
        raise ConfigError(
            "lora.target_modules",
            "vision-tower modules are listed (vLLM applies no LoRA there)",
            f"target the language model only, e.g. {LANGUAGE_MODEL_PROJECTIONS}",
        )
    if c.resume_mode == "path" and not c.resume_path:
        raise ConfigError(
            "checkpoint.resume_path", "resume_mode is 'path' but no path is given", "set checkpoint.resume_path"
        )
    if c.s3_uri is not None and (not c.s3_uri.startswith("s3://") or len(c.s3_uri) <= 5 or c.s3_uri[5] == "/"):
        raise ConfigError(
            "checkpoint.s3_uri", f"{c.s3_uri!r} is not an s3://bucket/prefix URI", "write s3://bucket/prefix"
        )
    if not m.path:
        raise ConfigError("model.path", "it is empty", "point it at a local HF model folder, or use 'tiny'")
    if m.adapter_init == "":
        raise ConfigError("model.adapter_init", "it is empty", "point it at a PEFT adapter folder, or leave it null")
    if not cfg.run_name or "/" in cfg.run_name or cfg.run_name in (".", ".."):
        raise ConfigError("run_name", f"{cfg.run_name!r} is not a plain folder name", "use letters, digits, - and _")
    if check_paths:
        _check_paths(cfg)


def _check_paths(cfg: Config) -> None:
    m, c = cfg.model, cfg.checkpoint
    if m.path != "tiny":
        if not Path(m.path).is_dir():
            raise ConfigError(
                "model.path", f"{m.path} is not a folder", "point it at a local HF model folder, or use 'tiny'"
            )
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(
                "model.path", f"{m.path} has no config.json", "point it at a folder saved by save_pretrained"
            )
    if m.adapter_init is not None and not (Path(m.adapter_init) / "adapter_config.json").is_file():
        raise ConfigError(
            "model.adapter_init",
            f"{m.adapter_init} has no adapter_config.json",
            "point it at a PEFT adapter folder (e.g. one written by scripts/sft.py)",
        )
    if m.adapter_init is not None:
        check_adapter_init(m.adapter_init, cfg.lora)
    if c.resume_mode == "path" and not c.resume_path.startswith("s3://") and not Path(c.resume_path).exists():
        raise ConfigError(
            "checkpoint.resume_path", f"{c.resume_path} does not exist", "give an existing checkpoint folder"
        )
