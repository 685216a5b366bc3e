"""The LoRA adapter as data: its tensor names and shapes, validation, and the PEFT folder format.

Every place an adapter crosses a boundary goes through here: the trainer's gathered state, the sync to
rollout engines (vLLM accepts an adapter of the wrong shapes without a word), the exported PEFT
folder, and the serving app. Names are PEFT's saved names
(`base_model.model.model.language_model.layers.{i}.self_attn.q_proj.lora_A.weight`), A is [r, in] and
B is [out, r].
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from app.config import LoraSettings

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model.model.language_model.layers"
# The vision tower (with its mergers) when trained whole beside the LoRA: PEFT's modules_to_save names for it
VISION_PREFIX = "base_model.model.model.visual."
# The language model's every weight when it trains whole beside the LoRA (modules_to_save [language_model]): the
# names the PEFT-wrapped model gives them (a LoRA-wrapped projection's own weight under `base_layer`), and its head
LANGUAGE_PREFIX = "base_model.model.model.language_model."
HEAD = "base_model.model.lm_head.weight"
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
# Wrapper segments that FSDP, activation checkpointing or torch.compile put into parameter names.
_WRAPPER_SEGMENTS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
# A parametrized weight's master (app.model.load.train_whole_modules): `x.parametrizations.weight.original`, `x.weight`
_PARAMETRIZED = re.compile(r"\.parametrizations\.(\w+)\.original$")


class AdapterMismatch(ValueError):
    """An adapter whose tensors do not fit the base model and LoRA settings."""


@dataclass(frozen=True)
class AdapterSpec:
    """What a valid adapter for one base model and LoRA setting looks like."""

    shapes: dict[str, tuple[int, ...]]
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    # whole modules trained and synced too: "visual" (the vision tower), "language_model" (its every weight, head in)
    modules_to_save: tuple[str, ...] = ()

    @classmethod
    def for_model(cls, text_config, settings: LoraSettings, vision_config=None) -> AdapterSpec:
        """vision_config: the model's, needed when settings.modules_to_save names the vision tower."""
        shapes = expected_shapes(text_config, settings.rank, settings.target_modules)
        if "visual" in settings.modules_to_save:
            if vision_config is None:
                raise AdapterMismatch("an adapter that trains the vision tower needs the model's vision config here")
            shapes.update(vision_shapes(vision_config))
        if "language_model" in settings.modules_to_save:
            shapes.update(language_shapes(text_config, settings.target_modules))
        return cls(
            shapes, settings.rank, settings.alpha, tuple(settings.target_modules), tuple(settings.modules_to_save)
        )

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())

    @property
    def whole_modules(self) -> dict[str, tuple[int, ...]]:
        """The shapes of the weights that train whole (the vision tower's, the language model's), not the LoRA's."""
        return {name: shape for name, shape in self.shapes.items() if not is_lora(name)}

    @property
    def lora_modules(self) -> int:
        """LoRA-wrapped projections (each an A and a B tensor)."""
        return sum(is_lora(name) for name in self.shapes) // 2

    def peft_config(self, base_model: str = "") -> dict:
        """adapter_config.json contents that PEFT and vLLM both load."""
        return {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": list(self.modules_to_save) or None,
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }


def module_dims(text_config, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a language-model projection."""
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
    q_out = text_config.num_attention_heads * head_dim
    kv_out = text_config.num_key_value_heads * head_dim
    dims = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    if module not in dims:
        raise AdapterMismatch(f"LoRA target '{module}' is not a language-model projection ({sorted(dims)})")
    return dims[module]


def expected_shapes(text_config, rank: int, target_modules) -> dict[str, tuple[int, int]]:
    shapes = {}
    for layer in range(text_config.num_hidden_layers):
        for module in sorted(target_modules):
            block = "self_attn" if module in _ATTENTION else "mlp"
            stem = f"{PEFT_PREFIX}.{layer}.{block}.{module}"
            fan_in, fan_out = module_dims(text_config, module)
            shapes[f"{stem}.lora_A.weight"] = (rank, fan_in)
            shapes[f"{stem}.lora_B.weight"] = (fan_out, rank)
    return shapes


def vision_shapes(vision_config) -> dict[str, tuple[int, ...]]:
    """The vision tower's parameters under PEFT's modules_to_save names, from its config (built on the meta device,
    no memory)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    with torch.device("meta"):
        tower = Qwen3VLVisionModel._from_config(vision_config)
    return {VISION_PREFIX + name: tuple(p.shape) for name, p in tower.named_parameters()}


def language_shapes(text_config, target_modules) -> dict[str, tuple[int, ...]]:
    """The language model's every parameter (embeddings, decoder layers, final norm, and the output head unless it is
    tied to the embeddings) under the names the LoRA-wrapped model gives them, from its config (meta device)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    with torch.device("meta"):
        text_model = Qwen3VLTextModel._from_config(text_config)
    shapes = {}
    for name, p in text_model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2] in target_modules:  # PEFT moves a wrapped projection's own weight down a level
            name = f"{module}.base_layer.{leaf}"
        shapes[LANGUAGE_PREFIX + name] = tuple(p.shape)
    if not getattr(text_config, "tie_word_embeddings", False):
        shapes[HEAD] = (text_config.vocab_size, text_config.hidden_size)
    return shapes


def is_language_weight(name: str) -> bool:
    """A language-model weight trained whole (PEFT names), not a LoRA tensor."""
    return (name.startswith(LANGUAGE_PREFIX) or name == HEAD) and not is_lora(name)


def check_tower(tensors: dict[str, torch.Tensor]) -> None:
    """AdapterMismatch unless every name is a vision tower weight's (`base_model.model.model.visual.*`)."""
    unknown = sorted(k for k in tensors if not k.startswith(VISION_PREFIX))
    if unknown:
        raise AdapterMismatch(f"{unknown[0]} is not a vision tower weight ({len(unknown)} such)")


def is_lora(name: str) -> bool:
    return ".lora_A" in name or ".lora_B" in name


def held_name(peft_name: str) -> str:
    """`...language_model.layers.3.mlp.up_proj.lora_B.weight` -> `layers.3.mlp.up_proj.lora_B`: a projection's name
    that PEFT and vLLM (which renames modules and stacks q/k/v) can both be brought to. A vision tower weight
    (`...model.visual.blocks.0.attn.qkv.weight`) keeps its name from `visual.` on, vLLM's name for it; a language-model
    weight becomes its name in the model folder less `model.` (`language_model.layers.0.self_attn.q_proj.weight`,
    `lm_head.weight`), to which vLLM's stacked projections are split back."""
    if is_language_weight(peft_name):
        return peft_name.removeprefix("base_model.model.").removeprefix("model.").replace(".base_layer.", ".")
    if not is_lora(peft_name):
        return peft_name[peft_name.index("visual.") :]
    stem = peft_name[peft_name.index("layers.") :]
    return stem[: -len(".weight")] if stem.endswith(".weight") else stem


def held_form(tensors: dict[str, torch.Tensor], rank: int, alpha: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An adapter as an engine holds it, for checking one against the other bit for bit: `held_name`s, the
    engine's dtype, and lora_B multiplied by alpha / r in that dtype (vLLM merges the scale into lora_B when it
    loads an adapter, with this same operation)."""
    scaling = alpha / rank
    out = {}
    for name, tensor in normalize_keys(tensors).items():
        held = tensor.detach().to("cpu", dtype, copy=True)
        if ".lora_B" in name and scaling != 1:  # the vision tower's weights are held as they are
            held *= scaling
        out[held_name(name)] = held.contiguous()
    return out


def normalize_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT saved names: no adapter name (`.default`), no FSDP/checkpoint wrapper segments."""
    out = {}
    for name, tensor in tensors.items():
        clean = _PARAMETRIZED.sub(r".\1", _WRAPPER_SEGMENTS.sub("", name)).replace(".default.", ".")
        if not clean.startswith("base_model.model."):
            clean = "base_model.model." + clean
        out[clean] = tensor
    return out


def validate(tensors: dict[str, torch.Tensor], spec: AdapterSpec, check_values: bool = True) -> None:
    """Raises AdapterMismatch unless the tensors are exactly the expected set, with the expected shapes.

    check_values also scans every value for NaN/inf (a full pass over the data); the sync path does that
    once in the trainer, so the receiving engines check names, shapes and dtypes only."""
    names = set(tensors)
    missing = sorted(set(spec.shapes) - names)
    unexpected = sorted(names - set(spec.shapes))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
    for name in sorted(names & set(spec.shapes)):
        t = tensors[name]
        if tuple(t.shape) != spec.shapes[name]:
            problems.append(f"{name} has shape {tuple(t.shape)}, expected {spec.shapes[name]}")
            break
        if not t.is_floating_point():
            problems.append(f"{name} has dtype {t.dtype}, expected a floating-point tensor")
            break
        if check_values and not torch.isfinite(t).all():
            problems.append(f"{name} holds NaN or infinite values")
            break
    if problems:
        raise AdapterMismatch(f"adapter does not fit the model (rank {spec.rank}): " + "; ".join(problems))


def private_copies(
    adapter: PackedTensors | dict[str, torch.Tensor], device: str | torch.device, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Contiguous copies of an adapter on `device` that nobody else holds: vLLM scales lora_B in place, which
    must never reach the caller's tensors or the object store's buffer.

    A packed adapter goes to an accelerator as one host-to-device copy of its buffer, the tensors then
    being views of it: 436 per-tensor copies of the 8B-shaped adapter each pay a transfer's latency.
    """
    device = torch.device(device)
    if isinstance(adapter, PackedTensors) and device.type != "cpu":
        flat = _as_tensor(adapter.buffer).to(device)
        views = _views(flat, adapter.index)
        return {k: v if dtype in (None, v.dtype) else v.to(dtype) for k, v in views.items()}
    return {
        k: v.detach().to(device, dtype=dtype or v.dtype, copy=True).contiguous() for k, v in unpack(adapter).items()
    }


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Raises AdapterMismatch if any value is NaN or infinite (one device sync for all tensors)."""
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()])
    if not bool(finite.all()):
        bad = [name for name, ok in zip(tensors, finite.tolist()) if not ok]
        raise AdapterMismatch(
            f"adapter does not fit the model: {bad[0]} holds NaN or infinite values "
            f"({len(bad)} of {len(tensors)} tensors do)"
        )


# ---------------------------------------------------------------- transport through Ray's object store


@dataclass
class PackedTensors:
    """Tensors as one contiguous uint8 buffer plus an index.

    Ray stores a numpy array in shared memory and hands readers a zero-copy view, while a dict of torch
    tensors is pickled and copied by every reader; packing makes the sync one copy in, none out.
    """

    buffer: np.ndarray
    index: list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, byte offset, byte count

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


def pack(tensors: dict[str, torch.Tensor]) -> PackedTensors:
    """One host buffer holding every tensor's bytes.

    Tensors on an accelerator are first laid out in one device buffer and then copied to pinned host
    memory in a single transfer: per-tensor copies from the GPU go through pageable staging one by one
    (0.2 s for the 8B-shaped adapter on an H200 box).
    """
    index, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        index.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
        offset += n
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), None)
    if device is not None and device.type == "cuda":
        flat = torch.cat(
            [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
            or [torch.empty(0, dtype=torch.uint8, device=device)]
        )
        host = torch.empty(offset, dtype=torch.uint8, pin_memory=True)  # torch caches pinned blocks
        host.copy_(flat)
        return PackedTensors(host.numpy(), index)  # the array keeps `host` alive
    buffer = np.empty(offset, dtype=np.uint8)
    for (name, _, _, start, n), t in zip(index, tensors.values()):
        buffer[start : start + n] = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return PackedTensors(buffer, index)


def _as_tensor(buffer: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only; nothing here writes to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(buffer)


def _views(flat: torch.Tensor, index) -> dict[str, torch.Tensor]:
    return {
        name: flat[start : start + n].view(getattr(torch, dtype)).reshape(shape)
        for name, dtype, shape, start, n in index
    }


def unpack(packed: PackedTensors | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors viewing the packed buffer (read-only when it came from Ray: copy before writing)."""
    if isinstance(packed, dict):
        return packed
    return _views(_as_tensor(packed.buffer), packed.index)


# ---------------------------------------------------------------- the PEFT folder


def write_peft_folder(
    tensors: dict[str, torch.Tensor], spec: AdapterSpec, out_dir: str | os.PathLike, base_model: str = ""
) -> Path:
    """Writes adapter_model.safetensors + adapter_config.json into out_dir (which must not be in use)."""

    validate(tensors, spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(private_copies(tensors, "cpu"), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(spec.peft_config(base_model), indent=2))
    return out


def read_peft_folder(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:

    folder = Path(path)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    return normalize_keys(load_file(str(folder / ADAPTER_WEIGHTS))), config


def spec_from_peft_config(text_config, config: dict, vision_config=None) -> AdapterSpec:
    """The spec an adapter folder claims, checked against the base model's shapes. vision_config: where the caller
    takes adapters that carry the vision tower (modules_to_save [visual]); without it such an adapter is refused."""
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise AdapterMismatch("adapter_config.json gives target_modules as a regex; list module names instead")
    saved = list(config.get("modules_to_save") or [])
    if set(saved) - {"visual", "language_model"}:
        raise AdapterMismatch(
            f"the adapter saves whole modules {saved}; only the vision tower (visual) and the language model "
            "(language_model) are known"
        )
    if "visual" in saved and vision_config is None:
        raise AdapterMismatch("the adapter carries the vision tower (modules_to_save [visual]): LoRA-only path")
    settings = LoraSettings(
        rank=int(config["r"]), alpha=int(config["lora_alpha"]), target_modules=list(targets), modules_to_save=saved
    )
    return AdapterSpec.for_model(text_config, settings, vision_config)
