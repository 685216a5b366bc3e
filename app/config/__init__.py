"""Every knob of a mazerl run, as typed dataclasses loaded from YAML plus dotted `key=value` overrides.

`load_config` reads the file, applies the overrides, checks every field's type, range and choices
(app/config/knobs.py, against the declarations in app/config/schema.py), then the checks across fields
(app/config/checks.py). Every failure is one `ConfigError` naming the field and the fix; `app.main` prints it
and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from app.config.checks import check_combinations, min_maze_turns
from app.config.knobs import ConfigError, from_dict, join_path, parse_yaml
from app.config.schema import (
    LANGUAGE_MODEL_PROJECTIONS,
    CheckpointConfig,
    Config,
    EvalConfig,
    LoraSettings,
    MazeSettings,
    MetricsConfig,
    ModelConfig,
    PlacementConfig,
    RolloutConfig,
    SftConfig,
    TinyModelShape,
    TrainConfig,
    WaitConfig,
)

__all__ = [
    "LANGUAGE_MODEL_PROJECTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LoraSettings",
    "MazeSettings",
    "MetricsConfig",
    "ModelConfig",
    "PlacementConfig",
    "RolloutConfig",
    "SftConfig",
    "TinyModelShape",
    "TrainConfig",
    "WaitConfig",
    "absolute_paths",
    "apply_override",
    "check_combinations",
    "describe",
    "field_docs",
    "load_config",
    "min_maze_turns",
]


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), check_paths: bool = True) -> Config:
    """Config from a YAML file (or the defaults) plus `a.b=value` overrides, fully validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(
                "<config file>", f"{p} is a folder, not a file", "pass the path of a YAML file, e.g. configs/tiny.yaml"
            )
        if not p.is_file():
            raise ConfigError(
                "<config file>", f"{p} does not exist", "pass the path of a YAML file, e.g. configs/tiny.yaml"
            )
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                "<config file>", f"{p} cannot be read as UTF-8 text ({e})", "save it as a UTF-8 YAML file"
            ) from None
        try:
            loaded = parse_yaml(text)
        except yaml.YAMLError as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError("<config file>", f"{p} is not valid YAML ({first})", "fix the YAML syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                "<config file>", f"{p} holds a {type(loaded).__name__}, not a mapping", "write key: value pairs"
            )
        if loaded is None:  # empty, or only comments: a file that says nothing is a mistake, not "the defaults"
            raise ConfigError(
                "<config file>",
                f"{p} is empty",
                "write the run's settings in it (configs/tiny.yaml is a start), or write {} to mean every default",
            )
        raw = loaded
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(Config, raw, "")
    check_combinations(cfg, check_paths=check_paths)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """Sets `a.b.c=value` in the raw dict; the value is parsed as YAML (so 3, 1e-5, true, [a, b] work)."""
    if "=" not in item:
        raise ConfigError(
            item, "an override must look like section.key=value", f"write e.g. train.lr=1e-5 instead of '{item}'"
        )
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(key.strip() or item, "empty key segment", "write dotted names like train.lr")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                key, f"'{part}' is a value, not a section", f"set it directly, e.g. {'.'.join(parts[: i + 1])}=<value>"
            )
        node = child
    node[parts[-1]] = value


def absolute_paths(cfg: Config) -> Config:
    """Actors run in other working directories: every path they see must be absolute."""
    run_dir = Path(cfg.output_dir).resolve() / cfg.run_name
    ck = cfg.checkpoint
    ck = replace(
        ck,
        ckpt_path=str(Path(ck.ckpt_path).resolve()) if ck.ckpt_path else str(run_dir / "checkpoints"),
        export_dir=str(Path(ck.export_dir).resolve()) if ck.export_dir else str(run_dir / "export"),
        resume_path=(
            ck.resume_path
            if not ck.resume_path or ck.resume_path.startswith("s3://")
            else str(Path(ck.resume_path).resolve())
        ),
    )
    model = cfg.model
    if model.path != "tiny":
        model = replace(model, path=str(Path(model.path).resolve()))
    if model.adapter_init:
        model = replace(model, adapter_init=str(Path(model.adapter_init).resolve()))
    return replace(cfg, output_dir=str(Path(cfg.output_dir).resolve()), checkpoint=ck, model=model)


def describe(cfg: Config) -> str:
    """The validated config as YAML, for `--plan` and the run folder."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, doc) for every knob, for documentation and `--help`-style listings."""
    out = []
    for f in dataclasses.fields(cls):
        name = join_path(prefix, f.name)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(field_docs(tp, name))
        else:
            out.append((name, f.metadata.get("doc", "")))
    return out
