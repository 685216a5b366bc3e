"""A trained policy as a model folder: its LoRA (and whatever trained whole beside it) merged into the base weights.

The folder loads wherever the base did (transformers, vLLM, the serving app as its model), with no adapter: the
export of a run whose language model trained whole (lora.modules_to_save [visual, language_model]), which is a
whole model rather than an adapter to swap, and the warm start a full-model SFT writes. PEFT merges
(`merge_and_unload`) and transformers writes the weights (`save_pretrained`); this module picks the files.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch

from app.config import LoraSettings

# Files of a model folder that the weights export rewrites; everything else (tokenizer, processor, chat
# template) is copied from the base folder, so the export loads wherever the base did (vLLM included).
_WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def export_full_model(
    model, base_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16", keep_model: bool = True
) -> Path:
    """The policy with its LoRA merged into the weights, as a model folder for `model.path`.

    Written beside `out_dir` and renamed into place, so an interrupted export never leaves a half folder.
    keep_model: merge a copy, leaving `model` as it was (False merges in place: no second copy in memory).
    """

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    merged = copy.deepcopy(model) if keep_model else model
    merged = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged
    merged.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    for f in Path(base_dir).iterdir():
        if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def merge_adapter_folder(
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    base_dir: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """An exported adapter folder (a run's global_step_N; one that carries whole modules included) merged into its
    base model (base_dir, else the folder's base_model_name_or_path) as a model folder at out_dir."""
    from app.model import adapters
    from app.model.load import apply_lora, load_model

    _, config = adapters.read_peft_folder(adapter_dir)
    base = base_dir or config.get("base_model_name_or_path")
    if not base or not Path(base, "config.json").is_file():
        raise ValueError(
            f"{adapter_dir}: its base model {base!r} is not a model folder here; give the base model's folder"
        )
    settings = LoraSettings(
        rank=int(config["r"]),
        alpha=int(config["lora_alpha"]),
        target_modules=list(config["target_modules"]),
        modules_to_save=list(config.get("modules_to_save") or []),
    )
    model = load_model(base, "float32")
    adapters.validate(
        adapters.read_peft_folder(adapter_dir)[0],
        adapters.AdapterSpec.for_model(model.config.text_config, settings, model.config.vision_config),
    )
    policy = apply_lora(model, settings, adapter_dir)
    return export_full_model(policy, base, out_dir, dtype, keep_model=False)
