"""The warm start's adapter (`model.adapter_init`) read before anything starts, and held to the run's `lora.*`.

The engines, every sync and every exported adapter_config.json use `lora.*`; the trainer loads the adapter's own
PEFT config. So the two must describe one adapter: the same rank, alpha, target modules and whole modules saved
(the vision tower, `lora.modules_to_save`), plain LoRA scaled by alpha / r. A mismatch would otherwise surface at
the first sync (rank, targets), after every actor started, or never (alpha: rollouts would sample a differently
scaled policy than the one trained). The adapter's dropout is not held to anything: the trainer loads it with
`lora.dropout`, which is 0 (app/config/checks.py says why).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.config.knobs import ConfigError
from app.config.schema import LoraSettings

FIELD = "model.adapter_init"


@dataclass(frozen=True)
class AdapterInit:
    """What an adapter folder's adapter_config.json says, as far as the run depends on it."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    modules_to_save: tuple[str, ...] = ()

    def describe(self) -> str:
        saved = f", with {list(self.modules_to_save)}" if self.modules_to_save else ""
        return f"LoRA r={self.rank}, alpha={self.alpha:g}, targets {list(self.target_modules)}{saved}"


def read_adapter_init(folder: str | Path) -> AdapterInit:
    path = Path(folder) / "adapter_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            FIELD,
            f"{path} cannot be read as JSON ({type(e).__name__})",
            "point it at a PEFT adapter folder whose adapter_config.json PEFT wrote (e.g. scripts/sft.py's)",
        ) from None
    return parse_adapter_config(config, path)


def parse_adapter_config(config: object, path: str | Path) -> AdapterInit:
    """What a PEFT adapter_config.json (read from `path`) says, refused under model.adapter_init's name when it is
    not a plain LoRA the engines can apply."""
    if not isinstance(config, dict):
        raise ConfigError(FIELD, f"{path} holds no JSON object", "point it at a PEFT adapter folder")
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(
            FIELD, f"the adapter is {config.get('peft_type')!r}, not LoRA", "start from a LoRA adapter (peft_type LORA)"
        )
    for flag, name in (("use_rslora", "rsLoRA (scaled by alpha / sqrt(r))"), ("use_dora", "DoRA")):
        if config.get(flag):
            raise ConfigError(
                FIELD,
                f"the adapter uses {name}; the engines apply plain LoRA scaled by alpha / r",
                f"start from a plain LoRA adapter ({flag}: false)",
            )
    saved = config.get("modules_to_save") or []
    if not isinstance(saved, list) or not set(saved) <= {"visual", "language_model"}:
        raise ConfigError(
            FIELD,
            f"its modules_to_save is {saved!r}; whole modules other than the vision tower (visual) and the language "
            "model (language_model) are not taken",
            "start from a LoRA adapter, or one written by a run with lora.modules_to_save [visual] or "
            "[visual, language_model]",
        )
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(x, str) for x in targets):
        raise ConfigError(
            FIELD,
            f"its target_modules is {targets!r}, not a list of module names",
            "start from an adapter whose adapter_config.json lists its target modules",
        )
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            FIELD, "its adapter_config.json has no usable r and lora_alpha", "point it at a PEFT adapter folder"
        ) from None
    return AdapterInit(rank, alpha, tuple(targets), tuple(saved))


def check_adapter_init(folder: str | Path, lora: LoraSettings) -> AdapterInit:
    """The adapter's config, refused with the field to change when it is not the adapter `lora.*` describes."""
    found = read_adapter_init(folder)
    check_same_adapter(found, lora, f"{FIELD}'s adapter")
    return found


def check_same_adapter(found: AdapterInit, lora: LoraSettings, whose: str, otherwise: str = "") -> None:
    """ConfigError naming the `lora.*` field where `found` (`whose` adapter) differs; `otherwise`: another fix."""
    if found.rank != lora.rank:
        raise ConfigError(
            "lora.rank",
            f"it is {lora.rank}, but {whose} has r={found.rank}",
            f"set lora.rank={found.rank} (lora.* shapes the engines and the exports){otherwise}",
        )
    if found.alpha != lora.alpha:
        raise ConfigError(
            "lora.alpha",
            f"it is {lora.alpha}, but {whose} has lora_alpha={found.alpha:g}",
            f"set lora.alpha={found.alpha:g}, or the engines would sample a differently scaled policy{otherwise}",
        )
    if set(found.target_modules) != set(lora.target_modules):
        listed = ", ".join(sorted(found.target_modules))
        raise ConfigError(
            "lora.target_modules",
            f"they are {sorted(lora.target_modules)}, but {whose} targets [{listed}]",
            f"set lora.target_modules=[{listed}]{otherwise}",
        )
    if set(found.modules_to_save) != set(lora.modules_to_save):
        listed = ", ".join(found.modules_to_save)
        raise ConfigError(
            "lora.modules_to_save",
            f"it is {list(lora.modules_to_save)}, but {whose} carries [{listed}]",
            f"set lora.modules_to_save=[{listed}] (what trains and syncs must be what the adapter holds){otherwise}",
        )
