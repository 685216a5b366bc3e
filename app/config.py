"""Every knob of a mazerl run, as typed dataclasses loaded from YAML plus dotted `key=value` overrides.

Each field is declared with `knob(default, doc, ...)`: the one-line doc and the allowed range live where
the field is declared, and `load_config` checks types, ranges and choices before anything starts. Checks
that involve several fields (a batch that must divide over the trainer ranks, a maze that cannot be solved
within the turn budget, paths that must exist) live in `check_combinations`. Every failure is one
`ConfigError` naming the field and the fix; `app.main` prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

LANGUAGE_MODEL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ConfigError(ValueError):
    """A config problem, told as the field, what is wrong, and how to fix it."""

    def __init__(self, field_path: str, problem: str, fix: str):
        self.field_path, self.problem, self.fix = field_path, problem, fix
        text = f"config error at '{field_path}': {problem}. Fix: {fix}"
        # one line whatever the user wrote: escape newlines and other non-printing characters
        super().__init__("".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text))


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5 (an exponent without a dot, YAML 1.2 style) as a float."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _parse_yaml(text: str) -> Any:
    """yaml.safe_load with 1e-5 as a float; PyYAML's own ValueError/KeyError/... become YAMLError."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError:
        raise
    except Exception as e:  # e.g. `!!float abc`, `!!bool maybe`, an int of more than 4300 digits
        raise yaml.YAMLError(f"{type(e).__name__}: {e}") from None


def knob(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None) -> Any:
    """A config field with its one-line doc and numeric bounds (checked by `load_config`)."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TinyModelShape:
    hidden_size: int = knob(128, "text hidden size", ge=32)
    intermediate_size: int = knob(256, "text MLP size", ge=32)
    num_layers: int = knob(2, "text decoder layers", ge=1)
    num_heads: int = knob(4, "attention heads", ge=1)
    num_kv_heads: int = knob(2, "key/value heads (must divide num_heads)", ge=1)
    head_dim: int = knob(32, "per-head size; vLLM's CPU attention needs 32, 64, 80, 96, 112 or 128", ge=8)
    vision_depth: int = knob(2, "vision tower blocks", ge=1)
    vision_hidden_size: int = knob(64, "vision tower width", ge=16)
    vision_heads: int = knob(2, "vision tower attention heads", ge=1)
    vocab_size: int = knob(1024, "BPE vocabulary trained locally, before the special tokens", ge=300)
    rope_theta: float = knob(5_000_000.0, "text RoPE base; Qwen's 5e6 leaves a small model ~1 frequency that tells "
                                          "neighbouring picture cells apart, 1e4 leaves several", gt=1.0)
    seed: int = knob(0, "seed of the random weights and of the tokenizer corpus")


@dataclass
class ModelConfig:
    path: str = knob("tiny", "local folder of a Qwen3-VL model in HF format, or 'tiny' to build one here")
    tiny: TinyModelShape = knob(TinyModelShape(), "shape of the model built when path is 'tiny'")
    adapter_init: str | None = knob(None, "PEFT adapter folder to start the policy from (the SFT warm start)")
    dtype: Literal["float32", "bfloat16"] = knob("float32", "weights and compute dtype")
    gradient_checkpointing: bool = knob(False, "recompute activations in the backward pass to save memory")


@dataclass
class LoraSettings:
    rank: int = knob(32, "LoRA rank r", ge=1, le=512)
    alpha: int = knob(64, "LoRA alpha; the update is scaled by alpha / rank", ge=1)
    dropout: float = knob(0.0, "LoRA dropout", ge=0.0, lt=1.0)
    target_modules: list[str] = knob(LANGUAGE_MODEL_PROJECTIONS,
                                     "module names that get LoRA; language-model projections only")


@dataclass
class MazeSettings:
    size: int = knob(9, "grid side including the wall border (odd): 9 is VisGym easy, 11 hard", ge=5, le=41)
    cell_px: int = knob(25, "pixels per maze cell in the rendered image", ge=4, le=128)
    feedback: Literal["visgym", "compass", "route"] = knob(
        "visgym", "observation text: VisGym's (what happened); plus where the goal lies (compass) or which way "
                  "a shortest path starts (route): hints for models that cannot yet see, at CPU scale")


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = knob("hf", "generation engine: vllm, or hf (transformers generate)")
    n_samples_per_prompt: int = knob(8, "episodes per maze in a GRPO group", ge=1)
    max_turns: int = knob(15, "actions per episode, the final stop included", ge=1)
    temperature: float = knob(1.0, "sampling temperature of training rollouts", gt=0.0, le=4.0)
    top_p: float = knob(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    max_new_tokens: int = knob(32, "token budget of one reply", ge=1, le=4096)
    gpu_memory_utilization: float = knob(0.45, "share of a GPU's memory a vLLM engine may take", gt=0.0, le=0.95)
    sleep_level: Literal[0, 1] = knob(1, "vLLM sleep between phases: 0 never, 1 weights to host memory (2 would wipe the LoRA slots)")
    image_history: int = knob(0, "keep only the last K maze images in the context; 0 keeps all", ge=0)
    turn_history: int = knob(0, "keep only the last K turns (reply + observation) after the task statement; "
                                "0 keeps all (1: the context is the task, the last action and the current picture)", ge=0)
    max_model_len: int = knob(4096, "longest context (prompt + replies) an engine accepts", ge=256)
    enforce_eager: bool = knob(True, "vLLM without CUDA graphs: fast start, slower decode")
    kv_cache_gb: float = knob(0.0, "a vLLM engine's KV cache in GiB on a GPU, set instead of measured: engines that start "
                                   "together on one GPU mis-measure each other (placement.rollouts_per_bundle > 1); "
                                   "0 sizes it from gpu_memory_utilization", ge=0.0)


@dataclass
class TrainConfig:
    lr: float = knob(3e-6, "AdamW learning rate", gt=0.0, le=1.0)
    epochs: int = knob(20, "passes over the training maze set", ge=1)
    dataset_size: int = knob(256, "training mazes in one epoch", ge=1)
    max_steps: int = knob(0, "stop after this many steps; 0 runs all epochs", ge=0)
    mazes_per_step: int = knob(8, "mazes per GRPO step (each played n_samples_per_prompt times)", ge=1)
    random_starts: float = knob(0.0, "share of a step's mazes whose group starts on a random open cell (not the goal) "
                                     "instead of VisGym's corner: shorter episodes whose rewards say more about each "
                                     "turn; evaluation always starts in the corner", ge=0.0, le=1.0)
    micro_batch: int = knob(4, "sequences per forward/backward on one trainer rank", ge=1)
    picture_cache_gb: float = knob(0.0, "processed pictures kept on the trainer's device, by content (repeated "
                                        "maze states skip the host-side image processor); 0 disables", ge=0.0)
    vision_cache_gb: float = knob(1.0, "the frozen vision tower's outputs kept per distinct picture on the trainer's "
                                       "device (one trainer process; app/vision_cache.py); 0 recomputes them", ge=0.0)
    update_epochs: int = knob(1, "optimizer passes over each step's batch", ge=1)
    clip_low: float = knob(0.2, "PPO ratio clip below 1", ge=0.0, lt=1.0)
    clip_high: float = knob(0.2, "PPO ratio clip above 1", ge=0.0)
    kl_coef: float = knob(0.0, "weight of the KL to the reference (adapter disabled); 0 skips that forward", ge=0.0)
    advantage: Literal["grpo", "drgrpo"] = knob("grpo", "grpo divides by the group std, drgrpo does not")
    drop_zero_variance_groups: bool = knob(False, "leave out groups whose samples all earned the same reward "
                                                  "(kept when step advantages still tell their turns apart)")
    min_informative_groups: int = knob(0, "dynamic sampling (DAPO): while fewer of a step's groups earned differing "
                                          "rewards, the step plays mazes_per_step more fresh mazes (app/driver.py "
                                          "sampling_phase); 0 plays one round", ge=0)
    refill_rounds: int = knob(0, "the most extra rounds of fresh mazes a step plays to reach min_informative_groups "
                                 "(bounds a step's rollout time at 1 + refill_rounds rounds)", ge=0)
    step_advantage_weight: float = knob(0.0, "weight of each turn's anchor-state advantage (GiGPO: its return compared "
                                             "with the group's other turns from the same cell) added to the episode's; "
                                             "0 is plain GRPO", ge=0.0)
    step_advantage_mode: Literal["grpo", "drgrpo"] = knob("grpo", "how a turn's return is compared within its anchor "
                                                         "group: grpo divides by the group's std (returns 0.95^10 and "
                                                         "0.95^11 become -1 and +1), drgrpo only centres it")
    step_discount: float = knob(0.95, "discount of a turn's return for the step advantage: gamma^(turns after it) x "
                                      "reward", gt=0.0, le=1.0)
    max_update_kl: float = knob(0.0, "bound on how far one training step moves the policy: k3 KL(before || after) on "
                                     "its batch, token mean; a step past it is shrunk by halves until it fits, and "
                                     "further passes are skipped (app/trust_region.py); 0 leaves steps unbounded", ge=0.0)
    entropy_coef: float = knob(0.0, "weight of an entropy bonus on the trained tokens (token mean, at the sampling "
                                    "temperature): keeps the spread between a group's runs that gives GRPO its signal, "
                                    "which collapsed in the GPU runs (docs/RESULTS.md, twelfth attempt); 0 skips it", ge=0.0)
    grad_clip: float = knob(1.0, "max global grad norm; 0 disables clipping", ge=0.0)
    weight_decay: float = knob(0.0, "AdamW weight decay", ge=0.0)
    warmup_steps: int = knob(0, "linear LR warm-up over this many training steps (each of update_epochs passes)", ge=0)
    lr_schedule: Literal["constant", "cosine"] = knob("constant", "LR after warm-up")
    seed: int = knob(42, "seed of the maze sampler, sampling and LoRA init")


@dataclass
class SftConfig:
    steps: int = knob(0, "supervised warm-start steps on BFS demonstrations before GRPO (fresh runs only); 0 skips", ge=0)
    lr: float = knob(1e-3, "learning rate of the warm start", gt=0.0, le=1.0)
    mazes_per_step: int = knob(8, "demonstrated mazes per warm-start step", ge=1)
    noise: float = knob(0.0, "chance that a demonstration turn is a random move (in context, not trained), so the "
                             "warm start also shows the way back from states off the shortest path", ge=0.0, lt=1.0)
    variants: int = knob(1, "distinct examples per maze (noise, random starts, question cells), each made once and "
                            "replayed in turn", ge=1)
    random_starts: float = knob(0.0, "share of demonstrations that start from a random open cell instead of the "
                                     "corner: the solver's way from every part of the maze", ge=0.0, le=1.0)
    perception: int = knob(0, "questions per demonstrated maze and step on which moves are open from a random cell "
                              "(free labels that teach a model from random weights to see walls); 0 asks none", ge=0)


@dataclass
class PlacementConfig:
    num_bundles: int = knob(1, "bundles N: N rollout actors and N trainer ranks, pair i sharing bundle i", ge=1)
    gpus_per_bundle: float = knob(0, "GPUs in each bundle: 0 on a CPU machine, 1 on a GPU box; 0.5 lets two jobs "
                                     "share one GPU (set rollout.gpu_memory_utilization to match)", ge=0, le=1)
    cpus_per_bundle: float = knob(1.0, "CPUs in each bundle, shared by its rollout actor and trainer rank", gt=0.0)
    colocate_all: bool = knob(True, "rollout actor i and trainer rank i share bundle i (phases alternate)")
    rollouts_per_bundle: int = knob(1, "rollout actors (engines) in each bundle, sharing its rollout GPU and CPUs: an "
                                       "in-process vLLM engine is one host thread, so small models generate faster "
                                       "from several", ge=1, le=16)
    evaluator_cpus: float = knob(0.1, "CPUs reserved for the evaluator", gt=0.0)
    consolidator_cpus: float = knob(0.1, "CPUs reserved for the checkpoint consolidator on the head node", gt=0.0)
    ray_address: str | None = knob(None, "Ray cluster to join ('auto' or host:port); none starts a local one")
    wait_for_resources_s: float = knob(120.0, "how long to wait for the placement group before failing", gt=0.0)


@dataclass
class EvalConfig:
    eval_interval: int = knob(10, "evaluate every this many steps; 0 only at start and end", ge=0)
    num_mazes: int = knob(64, "held-out mazes, played greedily once each", ge=1)
    seed: int = knob(1_000_000, "first seed of the held-out set (seeds seed..seed+num_mazes-1)", ge=0)
    at_start: bool = knob(True, "evaluate the starting policy before step 1")
    samples: int = knob(0, "also play each held-out maze this many times at rollout.temperature (sampled_solve_rate, "
                           "sampled_pass_at_k); 0 greedy only", ge=0)


@dataclass
class CheckpointConfig:
    ckpt_path: str = knob("", "folder of full training checkpoints; empty means <run dir>/checkpoints")
    ckpt_interval: int = knob(20, "write a full checkpoint every this many steps; 0 never", ge=0)
    hf_save_interval: int = knob(20, "export a PEFT adapter every this many steps; 0 never", ge=0)
    resume_mode: Literal["latest", "none", "path"] = knob("latest", "latest complete checkpoint, none, or resume_path")
    resume_path: str | None = knob(None, "checkpoint folder to resume from when resume_mode is 'path'")
    export_dir: str = knob("", "folder of exported adapters; empty means <run dir>/export")
    s3_uri: str | None = knob(None, "s3://bucket/prefix that also receives adapters and checkpoints")
    s3_endpoint_url: str | None = knob(None, "endpoint of an S3-compatible store; none uses AWS")
    keep_last: int = knob(3, "full checkpoints kept on disk; older ones are deleted", ge=1)
    max_failures: int = knob(3, "actor or node losses the driver recovers from before giving up", ge=0)


@dataclass
class MetricsConfig:
    prometheus: bool = knob(True, "export metrics through ray.util.metrics (Ray's Prometheus endpoint)")
    progress_bar: bool = knob(True, "show a progress bar with the latest solve rate")


@dataclass
class Config:
    run_name: str = knob("tiny", "name of the run: its folder under output_dir and its metric label")
    output_dir: str = knob("runs", "parent folder of run folders (logs, eval results, checkpoints)")
    model: ModelConfig = knob(ModelConfig(), "the policy model")
    lora: LoraSettings = knob(LoraSettings(), "the trained adapter")
    maze: MazeSettings = knob(MazeSettings(), "the maze world, for training and evaluation")
    rollout: RolloutConfig = knob(RolloutConfig(), "episodes and engines")
    train: TrainConfig = knob(TrainConfig(), "the GRPO update")
    sft: SftConfig = knob(SftConfig(), "the supervised warm start")
    placement: PlacementConfig = knob(PlacementConfig(), "Ray placement")
    eval: EvalConfig = knob(EvalConfig(), "the held-out evaluation")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "adapters, checkpoints, resume")
    metrics: MetricsConfig = knob(MetricsConfig(), "metrics and progress")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    @property
    def episodes_per_step(self) -> int:
        return self.train.mazes_per_step * self.rollout.n_samples_per_prompt

    @property
    def total_steps(self) -> int:
        per_epoch = -(-self.train.dataset_size // self.train.mazes_per_step)
        steps = self.train.epochs * per_epoch
        return min(steps, self.train.max_steps) if self.train.max_steps else steps


# ---------------------------------------------------------------- loading and type checks

def load_config(path: str | os.PathLike | None, overrides: list[str] = (), check_paths: bool = True) -> Config:
    """Config from a YAML file (or the defaults) plus `a.b=value` overrides, fully validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError("<config file>", f"{p} is a folder, not a file", "pass the path of a YAML file, e.g. configs/tiny.yaml")
        if not p.is_file():
            raise ConfigError("<config file>", f"{p} does not exist", "pass the path of a YAML file, e.g. configs/tiny.yaml")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("<config file>", f"{p} cannot be read as UTF-8 text ({e})", "save it as a UTF-8 YAML file") from None
        try:
            loaded = _parse_yaml(text)
        except yaml.YAMLError as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError("<config file>", f"{p} is not valid YAML ({first})", "fix the YAML syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("<config file>", f"{p} holds a {type(loaded).__name__}, not a mapping", "write key: value pairs")
        raw = loaded or {}
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(Config, raw, "")
    check_combinations(cfg, check_paths=check_paths)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """Sets `a.b.c=value` in the raw dict; the value is parsed as YAML (so 3, 1e-5, true, [a, b] work)."""
    if "=" not in item:
        raise ConfigError(item, "an override must look like section.key=value", f"write e.g. train.lr=1e-5 instead of '{item}'")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(key.strip() or item, "empty key segment", "write dotted names like train.lr")
    try:
        value = _parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(key, f"'{part}' is a value, not a section",
                              f"set it directly, e.g. {'.'.join(parts[:i + 1])}=<value>")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, raw: Any, where: str) -> Any:
    """Builds dataclass `cls` from a mapping, checking keys, types and bounds; errors name the dotted field."""
    if not isinstance(raw, dict):
        raise ConfigError(where or "<root>", f"expected a section (mapping), got {raw!r}", "write key: value pairs under it")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            if not close and len(str(key)) >= 2:  # lr_rate -> lr, n_samples -> n_samples_per_prompt
                close = sorted((f for f in fields if str(key).startswith(f) or f.startswith(str(key))), key=len)[-1:]
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
            raise ConfigError(_join(where, key), "unknown key", f"remove it or rename it; {hint}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        path = _join(where, name)
        value = _coerce(hints[name], raw[name], path)
        _check_bounds(f, value, path)
        values[name] = value
    return cls(**values)


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, {} if value is None else value, path)  # `train:` with nothing under it: defaults
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        if value not in args or type(value) is not type(next(a for a in args if a == value)):
            raise ConfigError(path, f"{value!r} is not one of {list(args)}", f"use one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {value!r}", "write a YAML list, e.g. [a, b]")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}", "write a whole number")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}", "write a number such as 0.5 or 1e-5")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(path, "the number is too large", "write a number such as 0.5 or 1e-5") from None
        if not math.isfinite(number):
            raise ConfigError(path, f"{value!r} is not a finite number", "write a finite number such as 0.5")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}", "quote the value")
        return value
    raise TypeError(f"config type {tp} of {path} is not supported")  # a bug in this module, not in the user's file


def _check_bounds(f: dataclasses.Field, value: Any, path: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    m = f.metadata
    for key, ok, word in (("ge", value >= (m.get("ge") or 0), ">="), ("gt", value > (m.get("gt") or 0), ">"),
                          ("le", value <= (m.get("le") or 0), "<="), ("lt", value < (m.get("lt") or 0), "<")):
        if m.get(key) is not None and not ok:
            raise ConfigError(path, f"{value} is out of range (must be {word} {m[key]})", f"set a value {word} {m[key]}")


# ---------------------------------------------------------------- checks across fields

def min_maze_turns(size: int) -> int:
    """Fewest turns any maze of this size needs: the corner-to-corner Manhattan distance plus the stop."""
    return 2 * (size - 3) + 1


def check_combinations(cfg: Config, check_paths: bool = True) -> None:
    """Checks that involve several fields, the environment, or the file system."""
    m, r, t, p, c = cfg.model, cfg.rollout, cfg.train, cfg.placement, cfg.checkpoint
    if cfg.maze.size % 2 == 0:
        raise ConfigError("maze.size", f"{cfg.maze.size} is even", "use an odd size such as 7, 9 or 11")
    need = min_maze_turns(cfg.maze.size)
    if r.max_turns < need:
        raise ConfigError("rollout.max_turns", f"{r.max_turns} turns cannot solve any {cfg.maze.size}x{cfg.maze.size} maze "
                          f"(the shortest possible path plus stop takes {need})",
                          f"raise rollout.max_turns to at least {need} or lower maze.size")
    episodes = cfg.episodes_per_step
    if episodes % p.num_bundles:
        raise ConfigError("train.mazes_per_step", f"{t.mazes_per_step} mazes x {r.n_samples_per_prompt} samples = "
                          f"{episodes} episodes do not divide over {p.num_bundles} trainer ranks",
                          f"make mazes_per_step * n_samples_per_prompt a multiple of placement.num_bundles ({p.num_bundles})")
    if t.min_informative_groups and not t.refill_rounds:
        raise ConfigError("train.refill_rounds", f"it is 0, so min_informative_groups ({t.min_informative_groups}) "
                          "can never send a step back for more mazes", "set train.refill_rounds to 1 or more (e.g. 3), "
                          "or train.min_informative_groups=0")
    if t.min_informative_groups > t.mazes_per_step * (1 + t.refill_rounds):
        raise ConfigError("train.min_informative_groups", f"{t.min_informative_groups} groups cannot come from "
                          f"{1 + t.refill_rounds} rounds of {t.mazes_per_step} mazes",
                          "lower it, or raise train.refill_rounds or train.mazes_per_step")
    if p.rollouts_per_bundle > 1 and r.engine == "vllm" and p.gpus_per_bundle > 0:
        if not r.kv_cache_gb:
            raise ConfigError("rollout.kv_cache_gb", f"it is 0 with {p.rollouts_per_bundle} engines a GPU: engines that "
                              "start together count each other's memory as their own and size their KV cache wrongly "
                              "(or fail)", "set rollout.kv_cache_gb, e.g. 2 for a small model")
        share = p.gpus_per_bundle * (0.5 if p.colocate_all else 1.0)
        if p.rollouts_per_bundle * r.gpu_memory_utilization > share + 1e-9:
            raise ConfigError("rollout.gpu_memory_utilization", f"{p.rollouts_per_bundle} engines x "
                              f"{r.gpu_memory_utilization} of the GPU is more than the {share:g} GPU their bundle gives "
                              "them", f"lower it to {share / p.rollouts_per_bundle:.3g} or less (it is the memory "
                              "an engine needs free at its start; kv_cache_gb is what it takes)")
    if t.advantage == "grpo" and r.n_samples_per_prompt < 2:
        raise ConfigError("rollout.n_samples_per_prompt", "GRPO needs at least 2 samples per maze to compare",
                          "set rollout.n_samples_per_prompt to 2 or more (8 in the reference run)")
    if m.tiny.num_heads % m.tiny.num_kv_heads:
        raise ConfigError("model.tiny.num_kv_heads", f"{m.tiny.num_kv_heads} does not divide num_heads {m.tiny.num_heads}",
                          "pick a divisor of num_heads")
    if r.engine == "vllm" and p.gpus_per_bundle == 0 and m.tiny.head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256) \
            and m.path == "tiny":
        raise ConfigError("model.tiny.head_dim", f"vLLM's CPU attention has no kernel for head_dim {m.tiny.head_dim}",
                          "use 32, 64, 80, 96, 112 or 128")
    if r.engine == "vllm" and p.gpus_per_bundle > 0 and m.dtype == "float32":
        raise ConfigError("model.dtype", "vLLM's LoRA kernels on GPU take only bfloat16 or float16 activations "
                          "(float32 fails at engine start)", "set model.dtype=bfloat16, or rollout.engine=hf")
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", "vllm is not installed in this Python", "run scripts/setup.sh, or set rollout.engine=hf")
    if set(cfg.lora.target_modules) & {"qkv", "proj", "linear_fc1", "linear_fc2", "attn.qkv", "attn.proj"}:
        raise ConfigError("lora.target_modules", "vision-tower modules are listed (vLLM applies no LoRA there)",
                          f"target the language model only, e.g. {LANGUAGE_MODEL_PROJECTIONS}")
    if c.resume_mode == "path" and not c.resume_path:
        raise ConfigError("checkpoint.resume_path", "resume_mode is 'path' but no path is given", "set checkpoint.resume_path")
    if c.s3_uri is not None and (not c.s3_uri.startswith("s3://") or len(c.s3_uri) <= 5 or c.s3_uri[5] == "/"):
        raise ConfigError("checkpoint.s3_uri", f"{c.s3_uri!r} is not an s3://bucket/prefix URI", "write s3://bucket/prefix")
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
            raise ConfigError("model.path", f"{m.path} is not a folder", "point it at a local HF model folder, or use 'tiny'")
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError("model.path", f"{m.path} has no config.json", "point it at a folder saved by save_pretrained")
    if m.adapter_init is not None and not (Path(m.adapter_init) / "adapter_config.json").is_file():
        raise ConfigError("model.adapter_init", f"{m.adapter_init} has no adapter_config.json",
                          "point it at a PEFT adapter folder (e.g. one written by scripts/sft.py)")
    if c.resume_mode == "path" and not c.resume_path.startswith("s3://") and not Path(c.resume_path).exists():
        raise ConfigError("checkpoint.resume_path", f"{c.resume_path} does not exist", "give an existing checkpoint folder")


def describe(cfg: Config) -> str:
    """The validated config as YAML, for `--plan` and the run folder."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, doc) for every knob, for documentation and `--help`-style listings."""
    out = []
    for f in dataclasses.fields(cls):
        name = _join(prefix, f.name)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(field_docs(tp, name))
        else:
            out.append((name, f.metadata.get("doc", "")))
    return out
